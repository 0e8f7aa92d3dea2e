"""Every key a genesis ``[config]`` table may hold: its type, bounds and meaning (pure).

Why: the ``[config]`` table is signed into the genesis as TOML text and read by key in
several rooms of ``node/``. Before this module a typo (``learning_rat``, ``tempreature``)
was signed into the genesis and silently ignored: the run trained with the defaults, and
nobody could change it afterwards (the run id hashes the genesis). Now ``run init``, the
devnet and every reader of a genesis (a genesis file, one received from the swarm) check
the table here and refuse an unknown key, naming the nearest known one, or a value of the
wrong type or out of its bounds.

:class:`RunConfig` is the table decoded, typed, with every default: nodes read it by
attribute (``RunContext.config``), never by string. docs/operating.md's table is checked
against it by ``tests/protocol/test_run_config.py``.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Mapping
from typing import Any

from protocol.errors import ProtocolError


@dataclasses.dataclass(frozen=True)
class ConfigKey:
    """One ``[config]`` key. ``kind``: "int", "float", "str", "bool" or "floats" (a list of
    numbers); ``lo``/``hi`` bound numbers (inclusive; ``lo_open``: strictly above ``lo``);
    ``choices`` bounds a string; ``size`` is the length of a "floats" list."""

    name: str
    kind: str
    default: Any
    meaning: str
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    choices: tuple[str, ...] = ()
    size: int = 0

    def check(self, value: Any) -> None:
        """Raise ``ProtocolError("config:<name>", ...)`` unless ``value`` fits this key."""
        if self.kind == "floats":
            if not isinstance(value, list) or len(value) != self.size or not all(_is_number(v) for v in value):
                self._refuse(value, f"a list of {self.size} numbers")
            for v in value:
                self._bounds(v, value)
            return
        if self.kind == "bool":
            if not isinstance(value, bool):
                self._refuse(value, "true or false")
            return
        if self.kind == "str":
            if not isinstance(value, str):
                self._refuse(value, "a string")
            if self.choices and value not in self.choices:
                self._refuse(value, f"one of {', '.join(self.choices)}")
            return
        if self.kind == "int" and (isinstance(value, bool) or not isinstance(value, int)):
            self._refuse(value, "an integer")
        if self.kind == "float" and not _is_number(value):
            self._refuse(value, "a number")
        self._bounds(value, value)

    def _bounds(self, v: float, shown: Any) -> None:
        if not math.isfinite(v):
            self._refuse(shown, "a finite number")
        below = self.lo is not None and (v <= self.lo if self.lo_open else v < self.lo)
        above = self.hi is not None and v > self.hi
        if below or above:
            self._refuse(shown, f"in {self.range_text()}")

    def range_text(self) -> str:
        """The bounds as an interval, e.g. "(0, 10]" or ">= 1"; "" when unbounded."""
        if self.choices:
            return " | ".join(self.choices)
        left = "(" if self.lo_open else "["
        if self.lo is not None and self.hi is not None:
            return f"{left}{self.lo:g}, {self.hi:g}]"
        if self.lo is not None:
            return f"{'>' if self.lo_open else '>='} {self.lo:g}"
        if self.hi is not None:
            return f"<= {self.hi:g}"
        return ""

    def _refuse(self, value: Any, want: str) -> None:
        raise ProtocolError(f"config:{self.name}", f"[config] {self.name} must be {want}, got {value!r}")


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


_DTYPES = ("float32", "bfloat16")


def _f(default: Any, kind: str, meaning: str, *, shown: str | None = None, **bounds: Any) -> Any:
    """A :class:`RunConfig` field: its default, and the :class:`ConfigKey` that checks it
    (``shown``: the default as docs state it, for a key whose default the rooms derive)."""
    return dataclasses.field(default=default, metadata={"key": (kind, meaning, shown, bounds)})


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """A genesis ``[config]`` table, decoded once (:meth:`decode`) when the genesis is read:
    one typed field per key, with its default, bounds and meaning. ``None`` stands for a
    default the rooms derive from other settings (a preset, the model, the genesis), as the
    ``shown`` text says. ``explicit`` names the keys the table set: the trainer's GRPO
    settings start from its own demo values and only keys a run sets override them."""

    # ------------------------------------------------------------ the run
    task: str = _f("", "str", "the built-in task the run was made for (informational)")
    steps: int = _f(0, "int", "training steps, then the trainer stops (0: train for ever)", lo=0)
    seed: int = _f(0, "int", "seed of version 0's weights and of problem pinning", lo=0, hi=9223372036854775807)
    numerics: str = _f("", "str", "the one numerics stack every node computes on, e.g. transformers-fp32-cpu")
    policy_dtype: str = _f("float32", "str", "dtype of the published weights", choices=_DTYPES)
    system_prompt: str | None = _f(None, "str", "system prompt of math problems (empty: none)", shown="(built in)")
    math_instruction: str | None = _f(None, "str", "instruction appended to a math problem", shown="(built in)")
    tiny_hidden_size: int = _f(256, "int", "the tiny model's hidden size", lo=8, hi=65536)
    tiny_layers: int = _f(4, "int", "the tiny model's layers", lo=1, hi=256)
    tiny_heads: int = _f(4, "int", "the tiny model's attention heads", lo=1, hi=256)
    # ------------------------------------------------------------ sampling
    temperature: float = _f(1.0, "float", "sampling temperature (workers, validators, trainer)", lo=0.0, hi=10.0)
    top_p: float = _f(1.0, "float", "nucleus sampling mass", lo=0.0, hi=1.0, lo_open=True)
    top_k: int = _f(0, "int", "top-k cut (0: none)", lo=0, hi=1048576)
    max_tokens: int = _f(48, "int", "most tokens per completion", lo=1, hi=1048576)
    # ------------------------------------------------------------ workers
    worker_batches_per_version: int = _f(0, "int", "batches per version a worker makes (0: continuous)", lo=0)
    worker_lead_versions: int = _f(0, "int", "versions a paced worker may run ahead", lo=0)
    worker_idle_s: float = _f(20.0, "float", "seconds with no new version before one more batch", lo=0, lo_open=True)
    # ------------------------------------------------------------ validation
    toploc_thresholds: str | None = _f(
        None,
        "str",
        "TOPLOC preset (tight when numerics is set)",
        shown="tight / cross-stack",
        choices=("paper", "cross-stack", "tight"),
    )
    toploc_max_exp_mismatches: int | None = _f(
        None, "int", "TOPLOC: exponent mismatches per chunk", shown="(preset)", lo=0
    )
    toploc_max_mant_err_mean: float | None = _f(None, "float", "TOPLOC: mean mantissa error", shown="(preset)", lo=0)
    toploc_max_mant_err_median: float | None = _f(
        None, "float", "TOPLOC: median mantissa error", shown="(preset)", lo=0
    )
    sampling_tolerance: str | None = _f(
        None,
        "str",
        "seeded-sampling replay preset (same for one fp32 stack)",
        shown="same / mixed",
        choices=("same", "mixed"),
    )
    sampling_delta: float | None = _f(
        None, "float", "largest near-tie score gap accepted", shown="(preset)", lo=0, hi=100
    )
    sampling_max_near_ties: int | None = _f(None, "int", "near ties allowed per completion", shown="(preset)", lo=0)
    sampling_near_tie_rate: float | None = _f(
        None, "float", "more near ties allowed per token", shown="(preset)", lo=0, hi=1
    )
    ban_after_rejections: int = _f(2, "int", "a validator bans a worker after this many rejected batches", lo=1)
    committee_size: int = _f(0, "int", "validators that verify each batch (0: every validator)", lo=0, hi=64)
    committee_deadline_s: float = _f(
        60.0, "float", "seconds before a silent committee member is replaced", lo=0, lo_open=True
    )
    # ------------------------------------------------------------ the trainer's intake
    batches_per_step: int = _f(1, "int", "batches a step waits for", lo=1)
    max_batches_per_step: int = _f(0, "int", "most batches a step trains (0: no cap)", lo=0)
    step_token_budget: int = _f(65536, "int", "most completion tokens a step trains", lo=1)
    reward_agreement: float = _f(1e-06, "float", "largest gap between validators' rewards that still agree", lo=0)
    ledger_prune_interval_s: float = _f(30.0, "float", "seconds between ledger prunes", lo=0, lo_open=True)
    ledger_max_pending: int = _f(256, "int", "pending batches whose envelopes the trainer keeps", lo=1)
    ledger_max_pending_bytes: int = _f(1073741824, "int", "bytes of pending envelopes kept", lo=1)
    ledger_max_unadmitted_rows: int = _f(100000, "int", "rows of never-admitted batches kept", lo=1)
    ledger_orphan_vote_ttl_s: float = _f(3600.0, "float", "seconds a vote for an unknown batch is kept", lo=0)
    # ------------------------------------------------------------ checkpoints
    anchor_every: int = _f(10, "int", "a full checkpoint every this many versions, deltas between", lo=1)
    delta_max_fraction: float = _f(
        0.5, "float", "a delta larger than this share of the full one is not sent", lo=0, hi=1, lo_open=True
    )
    # ------------------------------------------------------------ held-out evaluation
    heldout_size: int = _f(0, "int", "problems held out of training (run init --heldout)", lo=0)
    heldout_hash: str = _f("", "str", "hash of the held-out problems (written by run init)")
    eval_every: int = _f(0, "int", "the trainer scores the held-out split every N versions (0: never)", lo=0)
    eval_problems: int = _f(0, "int", "held-out problems per evaluation (0: all)", lo=0)
    eval_samples: int = _f(1, "int", "samples per problem in an evaluation", lo=1)
    eval_seed: int = _f(0, "int", "seed of the evaluation's samples", lo=0)
    # ------------------------------------------------------------ GRPO (node/rl/grpo.py GRPOConfig)
    # The trainer starts from its own demo values for lr, weight_decay, warmup_steps,
    # max_grad_norm, entropy_coef and micro_batch_size (node/roles/context.py GRPO_DEMO),
    # which these defaults state; GRPOConfig's own for the rest.
    lr: float = _f(0.0001, "float", "learning rate (INTELLECT-2: 3e-7)", lo=0, hi=1, lo_open=True)
    weight_decay: float = _f(0.0, "float", "AdamW weight decay", lo=0, hi=1)
    betas: tuple[float, ...] = _f((0.9, 0.99), "floats", "AdamW betas", lo=0, hi=1, size=2)
    adam_eps: float = _f(1e-08, "float", "AdamW epsilon", lo=0, lo_open=True)
    warmup_steps: int = _f(0, "int", "linear learning-rate warm-up steps", lo=0)
    max_grad_norm: float = _f(1.0, "float", "gradient clipping norm", lo=0, lo_open=True)
    clip_eps: float = _f(0.2, "float", "importance-ratio clip 1 +/- eps", lo=0)
    delta: float = _f(4.0, "float", "cap on the importance ratio (two-sided clipping)", lo=1)
    entropy_coef: float = _f(0.0, "float", "entropy bonus", lo=0)
    kl_coef: float = _f(0.0, "float", "KL penalty", lo=0)
    group_size: int | None = _f(
        None, "int", "completions per prompt (informational to the trainer)", shown="(genesis)", lo=1
    )
    prompts_per_step: int = _f(256, "int", "prompts per step (informational)", lo=1)
    mini_batches: int = _f(1, "int", "optimizer steps per batch", lo=1)
    micro_batch_size: int = _f(32, "int", "rollouts per forward/backward (memory only)", lo=1)
    micro_batch_tokens: int = _f(0, "int", "padded tokens per forward/backward (0: no cap)", lo=0)
    logprob_chunk_tokens: int | None = _f(
        None, "int", "completion rows per lm_head chunk (0: full)", shown="(by model)", lo=0
    )
    gradient_checkpointing: bool = _f(False, "bool", "recompute activations in backward")
    malloc_mmap_threshold: int = _f(1048576, "int", "glibc mmap threshold in the trainer (0: glibc's)", lo=0)
    param_dtype: str | None = _f(
        None, "str", "dtype the trainer keeps parameters in", shown="(policy_dtype)", choices=_DTYPES
    )
    adv_eps: float = _f(1e-06, "float", "advantage normaliser epsilon", lo=0, lo_open=True)
    pass_threshold: float = _f(1.0, "float", "a rollout passes at this reward (metrics only)")
    explicit: frozenset[str] = frozenset()

    @classmethod
    def decode(cls, table: Mapping[str, Any]) -> RunConfig:
        """The typed config of a ``[config]`` table; ``ProtocolError("config:<key>", ...)``
        for an unknown key (naming the nearest known one) or a value of the wrong type or out
        of bounds (:func:`check_run_config`). Integers given for a float key become floats."""
        check_run_config(table)
        values: dict[str, Any] = {}
        for name, value in table.items():
            kind = KEYS[name].kind
            if kind == "float":
                value = float(value)
            elif kind == "floats":
                value = tuple(float(v) for v in value)
            values[name] = value
        return cls(**values, explicit=frozenset(table))


def _keys() -> dict[str, ConfigKey]:
    keys = {}
    for f in dataclasses.fields(RunConfig):
        if "key" not in f.metadata:
            continue
        kind, meaning, shown, bounds = f.metadata["key"]
        value: Any = f.default
        default = shown if shown is not None else (list(value) if kind == "floats" else value)
        keys[f.name] = ConfigKey(f.name, kind, default, meaning, **bounds)
    return keys


# Every key, in the order of RunConfig's fields: what check_run_config and docs/operating.md use.
KEYS: dict[str, ConfigKey] = _keys()

# Keys a [config] table may not hold because they live elsewhere; refused with where they go.
MISPLACED = {
    "max_async": "max_async is a [run] field (run init --max-async)",
    "compute_dtype": "the trainer computes in policy_dtype; set that",
    "quorum": "quorum is a [run] field",
    "prompts_per_batch": "prompts_per_batch is a [run] field",
}


# Names people reach for, to the key that means it (for the "did you mean" hint only).
ALIASES = {
    "learning_rate": "lr",
    "warmup": "warmup_steps",
    "grad_clip": "max_grad_norm",
    "clip_grad_norm": "max_grad_norm",
    "entropy": "entropy_coef",
    "kl": "kl_coef",
    "max_new_tokens": "max_tokens",
}


def nearest_key(name: str) -> str | None:
    """The known key ``name`` most likely meant, or None."""
    near = difflib.get_close_matches(name, [*KEYS, *ALIASES], n=1, cutoff=0.6)
    return ALIASES.get(near[0], near[0]) if near else None


def check_run_config(config: Mapping[str, Any]) -> None:
    """Refuse a ``[config]`` table with an unknown key (naming the nearest known one) or a
    value of the wrong type or out of bounds: ``ProtocolError("config:<key>", ...)``."""
    for name, value in config.items():
        key = KEYS.get(name)
        if key is None:
            if name in MISPLACED:
                raise ProtocolError(f"config:{name}", f"[config] {name}: {MISPLACED[name]}")
            near = nearest_key(name)
            hint = f"; did you mean {near!r}?" if near else " (docs/operating.md lists every key)"
            raise ProtocolError(f"config:{name}", f"unknown [config] key {name!r}{hint}")
        key.check(value)
