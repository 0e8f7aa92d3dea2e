"""Every key a genesis ``[config]`` table may hold: its type, bounds and meaning (pure).

Why: the ``[config]`` table is signed into the genesis as TOML text and read by key in
several rooms of ``node/``. Before this module a typo (``learning_rat``, ``tempreature``)
was signed into the genesis and silently ignored: the run trained with the defaults, and
nobody could change it afterwards (the run id hashes the genesis). Now ``run init``, the
devnet and every reader of a genesis (a genesis file, one received from the swarm) check
the table here and refuse an unknown key, naming the nearest known one, or a value of the
wrong type or out of its bounds.

Defaults are stated for readers (docs/operating.md's table is checked against this one by
``tests/test_run_config.py``); an absent key keeps its meaning in the room that reads it.
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


def _k(name: str, kind: str, default: Any, meaning: str, **bounds: Any) -> ConfigKey:
    return ConfigKey(name, kind, default, meaning, **bounds)


_DTYPES = ("float32", "bfloat16")

KEYS: dict[str, ConfigKey] = {
    k.name: k
    for k in (
        # ------------------------------------------------------------ the run
        _k("task", "str", "", "the built-in task the run was made for (informational)"),
        _k("steps", "int", 0, "training steps, then the trainer stops (0: train for ever)", lo=0),
        _k("seed", "int", 0, "seed of version 0's weights and of problem pinning", lo=0, hi=2**63 - 1),
        _k("numerics", "str", "", "the one numerics stack every node computes on, e.g. transformers-fp32-cpu"),
        _k("policy_dtype", "str", "float32", "dtype of the published weights", choices=_DTYPES),
        _k("system_prompt", "str", "(built in)", "system prompt of math problems (empty: none)"),
        _k("math_instruction", "str", "(built in)", "instruction appended to a math problem"),
        _k("tiny_hidden_size", "int", 256, "the tiny model's hidden size", lo=8, hi=65536),
        _k("tiny_layers", "int", 4, "the tiny model's layers", lo=1, hi=256),
        _k("tiny_heads", "int", 4, "the tiny model's attention heads", lo=1, hi=256),
        # ------------------------------------------------------------ sampling
        _k("temperature", "float", 1.0, "sampling temperature (workers, validators, trainer)", lo=0.0, hi=10.0),
        _k("top_p", "float", 1.0, "nucleus sampling mass", lo=0.0, hi=1.0, lo_open=True),
        _k("top_k", "int", 0, "top-k cut (0: none)", lo=0, hi=1 << 20),
        _k("max_tokens", "int", 48, "most tokens per completion", lo=1, hi=1 << 20),
        # ------------------------------------------------------------ workers
        _k("worker_batches_per_version", "int", 0, "batches per version a worker makes (0: continuous)", lo=0),
        _k("worker_lead_versions", "int", 0, "versions a paced worker may run ahead", lo=0),
        _k("worker_idle_s", "float", 20.0, "seconds with no new version before one more batch", lo=0, lo_open=True),
        # ------------------------------------------------------------ validation
        _k(
            "toploc_thresholds",
            "str",
            "tight / cross-stack",
            "TOPLOC preset (tight when numerics is set)",
            choices=("paper", "cross-stack", "tight"),
        ),
        _k("toploc_max_exp_mismatches", "int", "(preset)", "TOPLOC: exponent mismatches per chunk", lo=0),
        _k("toploc_max_mant_err_mean", "float", "(preset)", "TOPLOC: mean mantissa error", lo=0),
        _k("toploc_max_mant_err_median", "float", "(preset)", "TOPLOC: median mantissa error", lo=0),
        _k(
            "sampling_tolerance",
            "str",
            "same / mixed",
            "seeded-sampling replay preset (same for one fp32 stack)",
            choices=("same", "mixed"),
        ),
        _k("sampling_delta", "float", "(preset)", "largest near-tie score gap accepted", lo=0, hi=100),
        _k("sampling_max_near_ties", "int", "(preset)", "near ties allowed per completion", lo=0),
        _k("sampling_near_tie_rate", "float", "(preset)", "more near ties allowed per token", lo=0, hi=1),
        _k("ban_after_rejections", "int", 2, "a validator bans a worker after this many rejected batches", lo=1),
        # ------------------------------------------------------------ the trainer's intake
        _k("batches_per_step", "int", 1, "batches a step waits for", lo=1),
        _k("max_batches_per_step", "int", 0, "most batches a step trains (0: no cap)", lo=0),
        _k("step_token_budget", "int", 65536, "most completion tokens a step trains", lo=1),
        _k("reward_agreement", "float", 1e-6, "largest gap between validators' rewards that still agree", lo=0),
        _k("ledger_prune_interval_s", "float", 30.0, "seconds between ledger prunes", lo=0, lo_open=True),
        _k("ledger_max_pending", "int", 256, "pending batches whose envelopes the trainer keeps", lo=1),
        _k("ledger_max_pending_bytes", "int", 1 << 30, "bytes of pending envelopes kept", lo=1),
        _k("ledger_max_unadmitted_rows", "int", 100000, "rows of never-admitted batches kept", lo=1),
        _k("ledger_orphan_vote_ttl_s", "float", 3600.0, "seconds a vote for an unknown batch is kept", lo=0),
        # ------------------------------------------------------------ checkpoints
        _k("anchor_every", "int", 10, "a full checkpoint every this many versions, deltas between", lo=1),
        _k(
            "delta_max_fraction",
            "float",
            0.5,
            "a delta larger than this share of the full one is not sent",
            lo=0,
            hi=1,
            lo_open=True,
        ),
        # ------------------------------------------------------------ held-out evaluation
        _k("heldout_size", "int", 0, "problems held out of training (run init --heldout)", lo=0),
        _k("heldout_hash", "str", "", "hash of the held-out problems (written by run init)"),
        _k("eval_every", "int", 0, "the trainer scores the held-out split every N versions (0: never)", lo=0),
        _k("eval_problems", "int", 0, "held-out problems per evaluation (0: all)", lo=0),
        _k("eval_samples", "int", 1, "samples per problem in an evaluation", lo=1),
        _k("eval_seed", "int", 0, "seed of the evaluation's samples", lo=0),
        # ------------------------------------------------------------ GRPO (node/rl/grpo.py GRPOConfig)
        _k("lr", "float", 1e-4, "learning rate (INTELLECT-2: 3e-7)", lo=0, hi=1, lo_open=True),
        _k("weight_decay", "float", 0.0, "AdamW weight decay", lo=0, hi=1),
        _k("betas", "floats", [0.9, 0.99], "AdamW betas", lo=0, hi=1, size=2),
        _k("adam_eps", "float", 1e-8, "AdamW epsilon", lo=0, lo_open=True),
        _k("warmup_steps", "int", 0, "linear learning-rate warm-up steps", lo=0),
        _k("max_grad_norm", "float", 1.0, "gradient clipping norm", lo=0, lo_open=True),
        _k("clip_eps", "float", 0.2, "importance-ratio clip 1 +/- eps", lo=0),
        _k("delta", "float", 4.0, "cap on the importance ratio (two-sided clipping)", lo=1),
        _k("entropy_coef", "float", 0.0, "entropy bonus", lo=0),
        _k("kl_coef", "float", 0.0, "KL penalty", lo=0),
        _k("group_size", "int", "(genesis)", "completions per prompt (informational to the trainer)", lo=1),
        _k("prompts_per_step", "int", 256, "prompts per step (informational)", lo=1),
        _k("mini_batches", "int", 1, "optimizer steps per batch", lo=1),
        _k("micro_batch_size", "int", 32, "rollouts per forward/backward (memory only)", lo=1),
        _k("micro_batch_tokens", "int", 0, "padded tokens per forward/backward (0: no cap)", lo=0),
        _k("logprob_chunk_tokens", "int", "(by model)", "completion rows per lm_head chunk (0: full)", lo=0),
        _k("gradient_checkpointing", "bool", False, "recompute activations in backward"),
        _k("malloc_mmap_threshold", "int", 1 << 20, "glibc mmap threshold in the trainer (0: glibc's)", lo=0),
        _k("param_dtype", "str", "(policy_dtype)", "dtype the trainer keeps parameters in", choices=_DTYPES),
        _k("adv_eps", "float", 1e-6, "advantage normaliser epsilon", lo=0, lo_open=True),
        _k("pass_threshold", "float", 1.0, "a rollout passes at this reward (metrics only)"),
    )
}

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
