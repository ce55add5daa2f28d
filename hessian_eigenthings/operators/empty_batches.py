"""Batches of zero samples: skipped before any product, said once, refused when they are all.

Cost: reading each batch's leading size (host integers, no device sync).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator

from hessian_eigenthings._warnings import EmptyBatchWarning, user_stacklevel
from hessian_eigenthings.batching import Batch, BatchSource, batch_size

# NOTE [empty batches]
# A batch of zero samples has no weight in an average over samples, and its
# own mean loss is 0/0. It is skipped before any product (an all-zero or NaN
# product never enters the sum), and the operator says once that it skipped
# such batches. Data with zero samples in all is a ValueError (the weighted
# mean would divide by zero). With full_dataset=False the next non-empty batch
# of the cycle is taken (at most one cycle). Kronecker factors skip them the
# same way in their pass over the data.


class EmptyBatches:
    """The batches of one pass without those of zero samples, for the operator named ``owner``."""

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self.said = False

    def filter(self, source: BatchSource) -> Iterator[Batch]:
        seen = skipped = 0
        if source.full_dataset:
            for raw in source.batches():
                seen += 1
                if batch_size(raw) == 0:
                    skipped += 1
                    continue
                yield raw
        else:
            try:
                cycle = len(source.dataloader)  # type: ignore[arg-type]
            except TypeError:
                cycle = 1024
            for _ in range(max(1, cycle)):
                raw = next(source.batches())
                seen += 1
                if batch_size(raw) != 0:
                    self.say(skipped, seen)
                    yield raw
                    return
                skipped += 1
        self.finish(skipped, seen)

    def finish(self, skipped: int, seen: int) -> None:
        """The end of a pass that skipped ``skipped`` of ``seen`` batches: said once, an error when
        they were all."""
        if not skipped:
            return
        self.say(skipped, seen)
        if skipped == seen:
            raise self.none_error(seen)

    def say(self, skipped: int, seen: int) -> None:
        """Warn once that ``skipped`` of ``seen`` batches had zero samples (when some had samples)."""
        if skipped and not self.said and skipped < seen:
            self.said = True
            warnings.warn(
                f"{self.owner}: {skipped} of {seen} batches had zero samples and were skipped "
                "(they carry no weight in the average over samples)",
                EmptyBatchWarning,
                stacklevel=user_stacklevel(),
            )

    @staticmethod
    def none_error(seen: int) -> ValueError:
        return ValueError(
            f"every batch of the data has zero samples ({seen} batches read); an average over samples "
            "needs at least one: check the dataset"
        )
