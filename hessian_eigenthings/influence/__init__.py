"""Influence functions on the library's curvature operators.

``score(q, z) = −∇L(q)ᵀ (C + λI)⁻¹ ∇L(z)``: the rate at which the loss on a query ``q`` changes
when the training example ``z`` is up-weighted (positive: ``z`` raises the query's loss; the
sign is Kronfluence's negated, NOTE [influence sign] in :mod:`.scores`). ``C`` is EK-FAC (the
default), K-FAC, the exact GGN or the damped Hessian of the task's objective.

    fitted = influence.fit(model, train_data, influence.causal_lm_task())
    scores = fitted.pairwise_scores(query_data, train_data)   # (n_query, n_train)
    tokens = fitted.token_scores(query_data, train_data)      # (n_query, n_train, positions)
    print(influence.top_k(scores, 5, train_data=train_data, tokenizer=tokenizer))

Several ranks: ``fit(..., ranks=Replicated())`` for a replicated model, ``fit(...,
ranks=Sharded(model))`` for a model sharded with FSDP2 (the Kronecker routes; NOTE [influence on
several ranks]).
"""

from hessian_eigenthings.influence.scores import Curvature, Influence, fit
from hessian_eigenthings.influence.tasks import InfluenceTask, causal_lm_task, supervised_task
from hessian_eigenthings.influence.top_k import TopInfluences, top_k

__all__ = [
    "Curvature",
    "Influence",
    "InfluenceTask",
    "TopInfluences",
    "causal_lm_task",
    "fit",
    "supervised_task",
    "top_k",
]
