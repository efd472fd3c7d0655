"""Model roles and per-token read-outs: one teacher-forced forward pass over prompt+response each.

Roles (thin wrappers over ``transformers`` models; see spec/models.md)::

    actor      any AutoModelForCausalLM                       π_θ(y_t | x, y_<t)
    reference  a frozen deep copy of the actor's initial weights (eval, requires_grad False)
    critic     :class:`Critic`: an AutoModel backbone + scalar value head, one value per position
    reward     :class:`RewardModel` (AutoModelForSequenceClassification, one label, read at the
               last attention_mask=1 position) or a plain function (prompt_ids, response_ids) -> float

Alignment (one sequence; prompt left-padded to width P, response right-padded to width T)::

    position      0 .. P-2   P-1        P      P+1    ...  P+T-2     P+T-1
    token         pads,x..   x_last     y_0    y_1    ...  y_{T-2}   y_{T-1}
    logits/value  ...        -> y_0     -> y_1 -> y_2 ...  -> y_{T-1} (unused)

    logits at position p score the token at p+1, so the response slice is [P-1, P+T-1);
    V(x, y_<t) is the critic's output at the position of the token before y_t: the same slice.

Causal attention + teacher forcing make each slice entry a function of (x, y_<t) only — the
per-prefix loops of :mod:`refppo.models.naive` compute the same numbers one prefix at a time.
``position_ids = clamp(cumsum(attention_mask) − 1, 0)`` is passed explicitly, so the amount of left
padding changes nothing (rotary models such as Llama depend on it).

Modules: :mod:`~refppo.models.batch` (:class:`SequenceBatch`, padding),
:mod:`~refppo.models.roles` (:class:`Critic`, :class:`RewardModel`, reference, eval mode),
:mod:`~refppo.models.readout` (the per-token read-outs above), :mod:`~refppo.models.tiny` (tiny
seeded models from configs), :mod:`~refppo.models.loading` (local directories). Import each
name from its module (``refppo.models.X``); the naive twins are in :mod:`~refppo.models.naive`.
"""
