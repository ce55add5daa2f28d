"""The built-in problem of ``hessian-eigenthings influence``: a tiny GPT-2 trained on generated
sentences, tokenized by characters. Nothing is downloaded: the vocabulary, the text and the
model's config are built here, and the model is initialised and trained from ``seed``.

The text is made of four animals, each with its own food, sound and place
(``the cat eats fish.``, ``the small dog barks.``, ``the cow sleeps in the barn.``); one
training sentence in eight is *odd*: one of its attributes belongs to another animal
(``the cat eats grass.``). The training sentences are ordered by animal, so a query's helpful
examples (negative scores) show up as a block of the heat map, and the odd sentences of the
query's animal are the natural candidates for the harmful ones (positive scores).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "ANIMALS",
    "CharTokenizer",
    "InfluenceProblem",
    "builtin_influence_problem",
    "generated_queries",
    "generated_sentences",
]

#: animal -> (food, sound, place)
ANIMALS: dict[str, tuple[str, str, str]] = {
    "cat": ("fish", "purrs", "on the mat"),
    "dog": ("bones", "barks", "in the yard"),
    "cow": ("grass", "moos", "in the barn"),
    "bird": ("seeds", "sings", "in the tree"),
}
# none starts with a vowel: "a {adj}{animal}" stays English
_ADJECTIVES = ("", "big ", "small ", "tall ", "young ", "fat ", "shy ", "lazy ")
_TEMPLATES = (
    "the {adj}{animal} eats {food}.",
    "the {adj}{animal} {sound}.",
    "the {adj}{animal} sleeps {place}.",
    "a {adj}{animal} likes {food}.",
)
#: one training sentence in eight takes one attribute from another animal
_ODD_FRACTION = 1 / 8
_PAD = "_"
_CHARACTERS = " .abcdefghijklmnopqrstuvwxyz"
#: the model's context; a --query longer than this is refused
MAX_LENGTH = 48


class CharTokenizer:
    """One token per character of ``" .a-z"``, and a padding token (id 0) that ``decode``
    leaves out. ``len(tokenizer)`` is the vocabulary size, as for HuggingFace tokenizers."""

    def __init__(self) -> None:
        self.symbols = _PAD + _CHARACTERS
        self._ids = {c: i for i, c in enumerate(self.symbols)}
        self.pad_id = 0

    def __len__(self) -> int:
        return len(self.symbols)

    def encode(self, text: str) -> list[int]:
        unknown = sorted({c for c in text if c not in self._ids or c == _PAD})
        if unknown:
            raise ValueError(
                f"characters {''.join(unknown)!r} are not in the vocabulary (lower-case letters, "
                "space and '.')"
            )
        return [self._ids[c] for c in text]

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self.symbols[i] for i in ids if i != self.pad_id)


@dataclass(frozen=True)
class Sentence:
    text: str
    animal: str
    odd: bool


def _draw(n: int, gen: torch.Generator) -> int:
    return int(torch.randint(n, (1,), generator=gen))


def _sentence(animal: str, gen: torch.Generator, odd: bool) -> Sentence:
    template = _TEMPLATES[_draw(len(_TEMPLATES), gen)]
    adj = _ADJECTIVES[_draw(len(_ADJECTIVES), gen)]
    attributes = ANIMALS[animal]
    if odd:
        others = [a for a in ANIMALS if a != animal]
        attributes = ANIMALS[others[_draw(len(others), gen)]]
    food, sound, place = attributes
    text = template.format(adj=adj, animal=animal, food=food, sound=sound, place=place)
    return Sentence(text, animal, odd)


def generated_sentences(n: int, gen: torch.Generator) -> list[Sentence]:
    """``n`` training sentences of the grammar (module docstring), drawn with ``gen``."""
    names = list(ANIMALS)
    out = []
    for _ in range(n):
        animal = names[_draw(len(names), gen)]
        odd = bool(torch.rand((1,), generator=gen) < _ODD_FRACTION)
        out.append(_sentence(animal, gen, odd))
    return out


def generated_queries(n: int, gen: torch.Generator, train_texts: Sequence[str]) -> list[str]:
    """``n`` sentences, never odd, about each animal in turn; held out from the training
    sentences and from each other while the grammar has enough of them."""
    names = list(ANIMALS)
    taken = set(train_texts)
    out = []
    for i in range(n):
        text = ""
        for _ in range(64):  # the grammar has 32 sentences per animal
            text = _sentence(names[i % len(names)], gen, odd=False).text
            if text not in taken:
                break
        taken.add(text)
        out.append(text)
    return out


def _batches(
    texts: Sequence[str], tokenizer: CharTokenizer, batch_size: int, device: torch.device
) -> list[dict[str, torch.Tensor]]:
    """Right-padded batches ``{"input_ids", "attention_mask"}``; padding counts in no loss
    (``causal_lm_task`` takes targets where the mask is 1)."""
    rows = [tokenizer.encode(t) for t in texts]
    length = max(len(r) for r in rows)
    ids = torch.full((len(rows), length), tokenizer.pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), length), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        mask[i, : len(r)] = 1
    ids, mask = ids.to(device), mask.to(device)
    return [
        {"input_ids": ids[i : i + batch_size], "attention_mask": mask[i : i + batch_size]}
        for i in range(0, len(rows), batch_size)
    ]


@dataclass
class InfluenceProblem:
    """The trained model (eval mode), its tokenizer, the training sentences and queries as
    batches, and what the run reports about them."""

    model: nn.Module
    tokenizer: CharTokenizer
    train_texts: list[str]
    train_animals: list[str]
    train_odd: list[bool]
    train_data: list[dict[str, torch.Tensor]]
    query_texts: list[str]
    query_data: list[dict[str, torch.Tensor]]
    description: str
    final_loss: float


def _model(vocab: int, dtype: torch.dtype, device: torch.device) -> nn.Module:
    import transformers

    # eager attention: every route (the exact GGN's forward-mode products too) differentiates it
    config = transformers.GPT2Config(  # type: ignore[call-arg]  # attn_implementation: a PretrainedConfig keyword
        vocab_size=vocab,
        n_positions=MAX_LENGTH,
        n_embd=32,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        attn_implementation="eager",
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    model: nn.Module = transformers.GPT2LMHeadModel(config)
    return model.to(device=device, dtype=dtype)


def builtin_influence_problem(
    *,
    n_train: int = 64,
    n_queries: int = 3,
    queries: Sequence[str] | None = None,
    seed: int = 0,
    train_steps: int = 150,
    batch_size: int = 16,
    dtype: torch.dtype = torch.float64,
    device: torch.device | str = "cpu",
) -> InfluenceProblem:
    """The subcommand's default problem (module docstring), deterministic for a given seed.

    ``queries``: texts to score instead of ``n_queries`` generated ones (one per animal in
    turn, never odd). The caller's global RNG is left as it was (the model's initialisation
    draws from torch's global generator, so it runs in a forked one).
    """
    device = torch.device(device)
    tokenizer = CharTokenizer()
    gen = torch.Generator().manual_seed(seed)
    sentences = generated_sentences(n_train, gen)
    # ordered by animal (stable: the drawn order within one): a query's block is contiguous
    names = list(ANIMALS)
    sentences.sort(key=lambda s: names.index(s.animal))
    train_texts = [s.text for s in sentences]
    query_texts = (
        generated_queries(n_queries, gen, train_texts) if queries is None else list(queries)
    )
    for q in query_texts:
        if len(q) > MAX_LENGTH:
            raise ValueError(f"query {q!r} has {len(q)} characters; the model takes {MAX_LENGTH}")
        if len(q) < 2:
            raise ValueError(
                f"query {q!r}: a query needs at least 2 characters (the first is only context)"
            )
        tokenizer.encode(q)  # refuses characters outside the vocabulary
    train_data = _batches(train_texts, tokenizer, batch_size, device)
    query_data = _batches(query_texts, tokenizer, len(query_texts), device)

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = _model(len(tokenizer), dtype, device)
    final = _train(model, train_data, train_steps)
    model.eval()
    n_params = sum(p.numel() for p in model.parameters())
    description = (
        f"built-in GPT-2 (2 layers, width 32, {n_params} parameters, character vocabulary of "
        f"{len(tokenizer)}), {train_steps} Adam steps on {n_train} generated sentences"
    )
    return InfluenceProblem(
        model=model,
        tokenizer=tokenizer,
        train_texts=train_texts,
        train_animals=[s.animal for s in sentences],
        train_odd=[s.odd for s in sentences],
        train_data=train_data,
        query_texts=query_texts,
        query_data=query_data,
        description=description,
        final_loss=final,
    )


def _train(model: nn.Module, data: list[dict[str, torch.Tensor]], steps: int) -> float:
    """``steps`` Adam steps, cycling over the batches; the last step's mean token loss. Nothing
    here draws random numbers (no dropout), so the result depends on the seed only through the
    initialisation."""
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    loss_value = float("nan")
    for step in range(steps):
        batch = data[step % len(data)]
        logits = model(**batch).logits[:, :-1]
        # the mean next-character loss over real characters (padding left out)
        targets = batch["input_ids"][:, 1:].masked_fill(batch["attention_mask"][:, 1:] == 0, -100)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        loss_value = float(loss.detach())
    for p in model.parameters():
        p.grad = None
    return loss_value
