"""Everything a role derives from the run genesis: dataset, tokenizer, model, knobs.

Every node computes the same context from the same signed genesis, which is
what lets validators recompute exactly what a worker owed and what its
rewards are. The genesis pins the dataset (``dataset_hash``: a node whose copy
differs refuses to join) and, for a Hugging Face model, the model's files
(``model_root``: version 0's weights, config and tokenizer, checked byte for byte
whether they come from this machine or from the swarm).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

from node.engines.base import InferenceEngine
from node.errors import ConfigError, ModelError, RoleError
from node.genesis_file import run_config
from proofs import ProofConfig
from protocol import RunGenesis, SamplingParams
from protocol.run_config import RunConfig

log = logging.getLogger(__name__)

# The devnet's tiny model (genesis [config] tiny_hidden_size / tiny_layers / tiny_heads override): big enough to learn the target-length task in minutes on 2 cores.
TINY_MODEL = dict(hidden_size=256, layers=4, heads=4)


# Tiny-model demo values of GRPO settings (what trained the devnet's tiny model on two CPU
# cores), overridable by the genesis [config] (RunConfig states them as its defaults);
# GRPOConfig's own defaults are INTELLECT-2's.
GRPO_DEMO: dict[str, Any] = dict(
    lr=1e-4, weight_decay=0.0, warmup_steps=0, max_grad_norm=1.0, entropy_coef=0.0, micro_batch_size=32
)

# TOPLOC thresholds a genesis can name ([config] toploc_thresholds). "paper": the
# defaults calibrated across GPUs (mixed hardware). "tight": for a run whose nodes all
# compute on one numerics stack, where honest chunks give ~0 mismatches; catches the
# one-token prompt edits the paper's thresholds miss (docs/proofs.md).
# "cross-stack": the paper's thresholds under the name that says when to use them: a worker and
# a validator on different stacks (a bf16 worker, an fp32 validator; another GPU or kernel)
# differ by precision noise that tight may not absorb; the default when no stack is declared.
TOPLOC_PRESETS = {"paper": ProofConfig(), "cross-stack": ProofConfig(), "tight": ProofConfig.tight()}
_THRESHOLD_KEYS = {
    "toploc_max_exp_mismatches": int,
    "toploc_max_mant_err_mean": float,
    "toploc_max_mant_err_median": float,
}


def proof_config_for(config: RunConfig) -> ProofConfig:
    """The run's TOPLOC thresholds from its genesis [config]: ``toploc_thresholds``
    ("paper", "cross-stack": the same numbers, or "tight"; default "tight" when the genesis
    declares one ``numerics`` stack for every node, else "cross-stack"), then any explicit
    ``toploc_max_*`` values (their types and bounds were checked when the config was decoded).
    Chunking (32 tokens, top-128, prefill included) is the wire format and fixed."""
    name = config.toploc_thresholds or ("tight" if config.numerics else "cross-stack")
    overrides: dict[str, Any] = {}
    for key, kind in _THRESHOLD_KEYS.items():
        value = getattr(config, key)
        if value is not None:
            overrides[key.removeprefix("toploc_")] = kind(value)
    return dataclasses.replace(TOPLOC_PRESETS[name], **overrides)


@dataclasses.dataclass(frozen=True)
class ReplayConfig:
    """How exactly a validator's replay of seeded sampling must match (``proofs.sampling``).

    ``max_tie_gap``: the largest score gap (scaled logit + noise) by which a claimed token may
    trail the validator's seeded argmax. Near-ties (gaps in (0, max_tie_gap]) are tolerated up
    to ``max_near_ties + near_tie_rate x length`` per completion: across numerics stacks
    they occur at a steady rate per token, so a fixed count would reject long honest
    completions. Calibrated by bench/verify.py (docs/proofs.md): on one stack honest gaps
    were all 0; a bf16 worker against an fp32 validator had 1.6 % of tokens at a gap in
    (0, 0.139] row scales (SmolLM2; 0.024 on the tiny model), and every attack test is
    rejected up to a relative max_tie_gap of 2.0. The genesis key keeps its first name,
    ``sampling_delta``: signed geneses carry it."""

    max_tie_gap: float
    max_near_ties: int
    near_tie_rate: float = 0.0
    relative: bool = False  # max_tie_gap in units of each row's logit scale (proofs.sampling.replay_many)

    def unit(self) -> str:
        return "row scales" if self.relative else "in score"

    def allowed_near_ties(self, length: int) -> int:
        return self.max_near_ties + int(self.near_tie_rate * length)


# [config] sampling_tolerance presets; "same" is the default when the genesis declares
# one numerics stack, else "mixed".
REPLAY_PRESETS = {
    "same": ReplayConfig(max_tie_gap=1e-3, max_near_ties=1),
    "mixed": ReplayConfig(max_tie_gap=0.3, max_near_ties=4, near_tie_rate=0.1, relative=True),
}


def replay_config_for(config: RunConfig) -> ReplayConfig:
    """The run's replay tolerance from its genesis [config]: ``sampling_tolerance`` ("same"
    or "mixed"), then explicit ``sampling_delta`` / ``sampling_max_near_ties`` /
    ``sampling_near_tie_rate``."""
    # "same" only for a declared fp32 stack: bf16 engines are not batch-invariant at 1e-3 (a
    # worker's cached decode and a validator's batched prefill round differently; a bf16 devnet
    # on "same" rejected honest workers by score gaps of ~0.005), so a bf16 stack gets "mixed"
    same = bool(config.numerics) and engine_dtype_for(config) == "float32"
    base = REPLAY_PRESETS[config.sampling_tolerance or ("same" if same else "mixed")]
    return ReplayConfig(
        base.max_tie_gap if config.sampling_delta is None else config.sampling_delta,
        base.max_near_ties if config.sampling_max_near_ties is None else config.sampling_max_near_ties,
        base.near_tie_rate if config.sampling_near_tie_rate is None else config.sampling_near_tie_rate,
        base.relative,
    )


# [config] policy_dtype: the precision of the published policy weights (and of the trainer's
# forward/backward; its master weights and optimizer state stay fp32). Absent: float32, so
# geneses written before the key existed keep their meaning. The short name is the one a
# numerics stack carries ("transformers-bf16-cpu").
POLICY_DTYPES = {"float32": "fp32", "bfloat16": "bf16"}


def policy_dtype_for(config: RunConfig) -> str:
    """The run's policy dtype name from its genesis [config] (``policy_dtype``, default
    "float32"). A declared ``numerics`` stack must name the dtype its engines compute in
    ("transformers-bf16-cpu"), so tight TOPLOC thresholds stay per stack *and* precision. That
    may differ from the policy dtype: CPU workers may run bf16 weights in fp32."""
    name = config.policy_dtype
    numerics = config.numerics
    if numerics and len([p for p in str(numerics).split("-") if p in POLICY_DTYPES.values()]) != 1:
        raise ConfigError(
            f"genesis numerics {numerics!r} must name its compute dtype once "
            f"({' or '.join(sorted(POLICY_DTYPES.values()))}), e.g. 'transformers-fp32-cpu'"
        )
    return str(name)


def engine_dtype_for(config: RunConfig) -> str:
    """The dtype workers' and validators' engines compute in: the one the genesis's
    ``numerics`` stack names ("transformers-bf16-cpu" -> "bfloat16"), else the policy dtype.
    A bf16 policy is thus sampled and re-prefilled in bf16 (as INTELLECT-2's vLLM workers
    did), not upcast to fp32; a run may still declare an fp32 stack over bf16 weights."""
    policy = policy_dtype_for(config)
    numerics = config.numerics
    if numerics:
        by_short = {short: name for name, short in POLICY_DTYPES.items()}
        for part in str(numerics).split("-"):
            if part in by_short:
                return by_short[part]
    return policy


@dataclasses.dataclass(frozen=True)
class WorkerPace:
    """How much a worker generates: by default (``batches_per_version`` 0) without pause while
    its policy is inside the ``max_async`` window (docs/rl.md, "the pipeline").

    A run may pace it (genesis ``worker_batches_per_version`` N, ``worker_lead_versions`` L):
    N batches for each version the worker learns of, and up to L versions' worth ahead of
    that, so it may be N x L batches ahead of the trainer's versions and generates while the
    trainer trains; it waits only when that far ahead. L 0 is lock-step (N batches per
    version, then wait for the next); the devnet runs L 1, where generating more than the
    trainer takes would only be work the trainer throws away, on cores the trainer needs
    (docs/benchmarks.md, "Asynchronous pipeline"). With no new version for ``idle_s`` (a
    trainer restarting; batches lost with it) one more batch is made instead of idling for
    ever. A worker-side choice only: nobody else checks it (a worker's counters form one chain
    whatever its pace)."""

    batches_per_version: int
    idle_s: float
    lead_versions: int = 0


def worker_pace_for(config: RunConfig) -> WorkerPace:
    return WorkerPace(
        batches_per_version=config.worker_batches_per_version,
        idle_s=config.worker_idle_s,
        lead_versions=config.worker_lead_versions,
    )


@dataclasses.dataclass
class RunContext:
    """The run as this node sees it. ``model_dir`` is the verified folder of a model the
    genesis pins by content (``model_root``): found locally at start, or filled in by
    :meth:`adopt_model_files` once version 0 arrived from the swarm. Until then the
    tokenizer is unknown, and asking for it is an error (roles fetch version 0 first)."""

    genesis: RunGenesis
    config: RunConfig  # the genesis [config], decoded once (protocol/run_config.py)
    problems: list[Any]
    _tokenizer: Any
    cache_dir: Path
    model_dir: Path | None = None
    model_note: str = ""  # why a pinned model was not taken from this machine
    # problems the genesis holds out ([config] heldout_size): never assigned to a worker (the
    # assignment draws indices into ``problems`` only); scored by ``primenode eval --split
    # heldout`` and the trainer's periodic evaluation ([config] eval_every)
    heldout: list[Any] = dataclasses.field(default_factory=list)
    _rows: dict[Path, int] = dataclasses.field(default_factory=dict, repr=False)  # config.json vocab_size

    @classmethod
    def from_genesis(cls, genesis: RunGenesis, cache_dir: Path) -> RunContext:
        config = run_config(genesis)
        problems, heldout = run_problems(genesis, config)
        policy_dtype_for(config)  # a numerics stack naming no dtype fails at join, not at the first batch
        ctx = cls(genesis, config, problems, None, Path(cache_dir), heldout=heldout)
        if genesis.model_root:
            ctx._use_local_model()
        else:
            ctx._tokenizer = make_tokenizer(genesis.model, cache_dir)
        return ctx

    # ------------------------------------------------------------ model by content
    @property
    def pinned_model(self) -> bool:
        """True when the genesis pins the model's files by content (``model_root``)."""
        return bool(self.genesis.model_root)

    @property
    def model_ready(self) -> bool:
        """True once this node holds the model's tokenizer (and, if pinned, its verified files)."""
        return self._tokenizer is not None

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            self._require_model_dir()
        return self._tokenizer

    def _require_model_dir(self) -> Path:
        if self.model_dir is None:
            raise ModelError(
                f"the run's model (content root {self.genesis.model_root.hex()[:16]}) is not on this node yet: "
                "it arrives as version 0 from the swarm"
            )
        return self.model_dir

    @property
    def pinned_model_dir(self) -> Path:
        """Where this node keeps the verified files of the pinned model (one folder per content root)."""
        return self.cache_dir / "models" / self.genesis.model_root.hex()

    def _use_local_model(self) -> None:
        """Take the pinned model from this machine when it is here: a folder verified before, files
        an operator put into :attr:`pinned_model_dir` (a trainer whose folder lives elsewhere than
        the genesis says), or the genesis's model spec (a folder, or ``hf:owner/name@rev`` in the
        local hub cache), whichever hashes to the genesis's root. Otherwise leave it to version 0
        from the swarm, noting why in :attr:`model_note`."""
        from node.models import model_files, model_source_folder, stage_model, verified_model_dir

        g = self.genesis
        dest = self.pinned_model_dir
        if verified_model_dir(dest, g.model_root):
            self._set_model_dir(dest)
            return
        sources = [(f"{dest} (unverified)", dest)] if dest.is_dir() else []
        notes = []
        try:
            sources.append((g.model, model_source_folder(g.model)))
        except ModelError as exc:
            notes.append(str(exc))
        for what, folder in sources:
            try:
                stage_model(model_files(folder), dest, g.chunk_size, g.model_root)
            except ModelError as exc:  # other bytes under the right name: never used
                notes.append(f"{what}: {exc}")
                continue
            self._set_model_dir(dest)
            return
        self.model_note = "; ".join(notes)
        log.info("the pinned model is not on this machine (%s): will fetch version 0", self.model_note)

    def adopt_model_files(self, files: dict[str, Path]) -> None:
        """Version 0's files, assembled from the swarm: stage them as this node's model folder,
        hashing every byte against the genesis's ``model_root`` (ModelError names both roots
        if they differ), then load the tokenizer. Blocking: run it in a thread."""
        from node.models import stage_model

        g = self.genesis
        stage_model(files, self.pinned_model_dir, g.chunk_size, g.model_root)
        self._set_model_dir(self.pinned_model_dir)

    def _set_model_dir(self, folder: Path) -> None:
        from node.models import load_pinned_tokenizer

        self._tokenizer = load_pinned_tokenizer(folder)
        self.model_dir = folder

    # ------------------------------------------------------------ knobs
    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(
            temperature=self.config.temperature,
            top_p=self.config.top_p,
            max_tokens=self.config.max_tokens,
            top_k=self.config.top_k,
        )

    @property
    def numerics(self) -> str | None:
        """The numerics stack the genesis requires of every worker and validator
        (e.g. "transformers-fp32-cpu"), or None for a mixed-hardware run."""
        return self.config.numerics or None

    @property
    def policy_dtype(self) -> Any:
        """The run's policy dtype as a ``torch.dtype`` (``torch.float32`` or ``torch.bfloat16``):
        published weights are in it, and the trainer computes forward/backward in it."""
        import torch

        dtype = getattr(torch, policy_dtype_for(self.config))
        assert isinstance(dtype, torch.dtype)
        return dtype

    @property
    def engine_dtype(self) -> Any:
        """The ``torch.dtype`` engines compute in (``engine_dtype_for``)."""
        import torch

        dtype = getattr(torch, engine_dtype_for(self.config))
        assert isinstance(dtype, torch.dtype)
        return dtype

    @property
    def proof_config(self) -> ProofConfig:
        return proof_config_for(self.config)

    @property
    def replay_config(self) -> ReplayConfig:
        return replay_config_for(self.config)

    @property
    def worker_pace(self) -> WorkerPace:
        return worker_pace_for(self.config)

    @property
    def vocab_size(self) -> int:
        """Token ids the model can emit: its output rows (``config.json`` ``vocab_size``) when
        the model is a folder, and never fewer than the tokenizer knows, added special tokens
        included (``len(tokenizer)``: an HF tokenizer's ``vocab_size`` leaves out added tokens,
        such as Qwen's and Llama 3's EOS). Qwen pads its rows past the tokenizer (151,936 rows
        for 151,665 ids) and a policy may sample a padding row, so a validator whose engine is
        not built yet must bound ids exactly as its engine will (``engine.vocab_size``, the
        rows), or the same honest batch is refused or accepted by when it arrives."""
        tok = self.tokenizer
        try:
            n = len(tok)
        except TypeError:
            n = 0
        return max(n, int(getattr(tok, "vocab_size", 0) or 0), self._model_rows())

    def _model_rows(self) -> int:
        folder = self.model_dir or Path(self.genesis.model)
        if folder not in self._rows:  # read once per folder: validators ask for every batch
            try:
                value = json.loads((folder / "config.json").read_text()).get("vocab_size")
            except (OSError, ValueError, AttributeError):
                value = 0
            self._rows[folder] = value if isinstance(value, int) and not isinstance(value, bool) else 0
        return self._rows[folder]

    def check_engine(self, engine: InferenceEngine) -> None:
        """Refuse to work or validate on another stack than the genesis declares: tight
        thresholds assume worker and validator numerics agree bit for bit (nearly)."""
        want = self.numerics
        have = engine.numerics
        if want and have != want:
            raise RoleError(f"this run requires the numerics stack {want!r}; this node's engine is {have!r}")

    @property
    def eos_token_id(self) -> int | None:
        return self.tokenizer.eos_token_id

    @property
    def pad_token_id(self) -> int:
        pad = getattr(self.tokenizer, "pad_token_id", None)
        return pad if pad is not None else (self.eos_token_id or 0)

    def grpo_config(self):
        from node.rl.grpo import GRPOConfig

        base = dict(
            GRPO_DEMO,
            temperature=self.sampling.temperature,
            max_tokens=self.sampling.max_tokens,
            group_size=self.genesis.group_size,
            max_async=self.genesis.max_async,
        )
        # only what the run set overrides the demo values (RunConfig.explicit)
        base.update({k: getattr(self.config, k) for k in self.config.explicit if k in GRPOConfig.__dataclass_fields__})
        base["max_async"] = self.genesis.max_async
        base["compute_dtype"] = policy_dtype_for(self.config)
        return GRPOConfig.from_dict(base)

    # ------------------------------------------------------------ prompts
    def prompt_tokens(self, index: int) -> list[int]:
        """The prompt of problem ``index`` as token ids: through the model's chat template
        with the run's system prompt and math instruction (``node.rl.tasks.prompt_token_ids``)."""
        return self.problem_tokens(self.problems[index])

    def problem_tokens(self, problem: Any) -> list[int]:
        """Any problem's prompt as the run's workers would put it (held-out ones included)."""
        from node.rl.tasks import PromptStyle, prompt_token_ids

        return prompt_token_ids(self.tokenizer, problem, PromptStyle.from_config(self.config))

    def decode(self, tokens: list[int]) -> str:
        try:
            return self.tokenizer.decode(tokens, skip_special_tokens=True)
        except TypeError:
            return self.tokenizer.decode(tokens)

    def reward(self, index: int, tokens: list[int]) -> float:
        return self.reward_checked(index, tokens)[0]

    def reward_checked(self, index: int, tokens: list[int]) -> tuple[float, bool]:
        """The rules' reward and whether computing it was deterministic: a code test that
        timed out may pass on a faster machine, so its reward is no proof of a lie."""
        from node.rl.rewards import compute_reward

        res = compute_reward(self.problems[index], self.decode(tokens), tokens, eos_token_id=self.eos_token_id)
        return float(res.reward), res.details.get("status") != "timeout"

    # ------------------------------------------------------------ models
    def initial_model(self):
        """Version 0 of the policy: the same weights on every node that builds it."""
        seed = self.config.seed
        if self.genesis.model == "tiny":
            from node.models import tiny_llama

            tok = self.tokenizer
            size = {k: int(getattr(self.config, f"tiny_{k}")) for k in TINY_MODEL}
            return tiny_llama(
                vocab_size=tok.vocab_size,
                hidden_size=size["hidden_size"],
                layers=size["layers"],
                heads=size["heads"],
                seed=seed,
                eos_token_id=tok.eos_token_id,
            )
        if self.genesis.model == "smollm2":
            from node.models import load_smollm2

            model, _ = load_smollm2(self.cache_dir)
            return model
        if self.pinned_model:
            from node.models import load_pinned_model

            return load_pinned_model(self._require_model_dir())
        path = Path(self.genesis.model)
        if path.is_dir():
            import torch
            from transformers import AutoModelForCausalLM

            return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        raise ModelError(f"unknown model {self.genesis.model!r}: use tiny, smollm2 or a local model folder")


def make_tokenizer(model: str, cache_dir: Path):
    if model == "tiny":
        from node.rl.tasks import CharTokenizer

        return CharTokenizer()
    if model == "smollm2":
        from node.models import load_smollm2

        _, tok = load_smollm2(cache_dir)
        return tok
    path = Path(model)
    if path.is_dir():
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)
    raise ModelError(f"unknown model {model!r}: use tiny, smollm2 or a local model folder")


def check_dataset(genesis: RunGenesis, problems: list[Any]) -> None:
    """Refuse to join a run whose pinned dataset differs from the one this node loaded."""
    if not genesis.dataset_hash:
        return
    from node.rl.tasks import dataset_hash

    have = dataset_hash(problems)
    if have != genesis.dataset_hash:
        raise ConfigError(
            f"dataset {genesis.dataset} on this node hashes to {have.hex()}, "
            f"the genesis pins dataset_hash {genesis.dataset_hash.hex()}: "
            "this node's copy of the dataset differs from the run's"
        )


def split_heldout(problems: list[Any], want: int, seed: int) -> tuple[list[Any], list[Any]]:
    """(training problems in their order, held-out problems) by ``node.rl.scoring.heldout_indices``."""
    from node.rl.scoring import heldout_indices

    try:
        held = set(heldout_indices([p.prompt for p in problems], want, seed))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return [p for i, p in enumerate(problems) if i not in held], [p for i, p in enumerate(problems) if i in held]


def run_problems(genesis: RunGenesis, config: RunConfig) -> tuple[list[Any], list[Any]]:
    """(training problems, held-out problems) of a run, each checked against its pinned hash.

    The dataset spec names ``dataset_size + heldout_size`` problems; the held-out split takes
    ``heldout_size`` of them by prompt hash (``split_heldout``); the training problems keep
    their order and are what ``dataset_size``, ``dataset_hash`` and every prompt index mean,
    so a held-out problem cannot be assigned: the assignment draws indices below
    ``dataset_size`` into the training list (``protocol.assign_prompts``)."""
    seed = config.seed
    held_n = config.heldout_size
    problems = load_problems(genesis.dataset, genesis.dataset_size + held_n, seed)
    train, heldout = split_heldout(problems, held_n, seed) if held_n else (problems, [])
    if len(heldout) != held_n:
        raise ConfigError(
            f"dataset {genesis.dataset}: the held-out split gives {len(heldout)} problems, the genesis says {held_n}"
        )
    check_dataset(genesis, train)
    want = config.heldout_hash
    if held_n and want:
        from node.rl.tasks import dataset_hash

        have = dataset_hash(heldout).hex()
        if have != want:
            raise ConfigError(
                f"the held-out problems of {genesis.dataset} hash to {have}, the genesis pins heldout_hash {want}"
            )
    return train, heldout


def pin_problems(spec: str, size: int | None, seed: int, heldout: int = 0) -> tuple[dict[str, Any], dict[str, Any]]:
    """(genesis fields, [config] keys) that pin a run's problems: ``dataset_size`` and
    ``dataset_hash`` of the training problems and, with ``heldout`` > 0, ``heldout_size`` and
    ``heldout_hash`` of the held-out split. ``size``: training problems of a built-in task
    (default 1024; the held-out ones are generated on top), or the problems of a file to use
    (default: all of them, held-out ones included). Reads every byte."""
    from node.rl import tasks

    builtin = spec.startswith("builtin:")
    try:
        if builtin:
            total = (1024 if size is None else size) + heldout
        else:
            total = len(tasks.load_dataset(spec)) if size is None else size
        problems = load_problems(spec, total, seed)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"dataset {spec}: {exc}") from None
    train, held = split_heldout(problems, heldout, seed) if heldout else (problems, [])
    fields: dict[str, Any] = {"dataset": spec, "dataset_size": len(train), "dataset_hash": tasks.dataset_hash(train)}
    config: dict[str, Any] = {}
    if heldout:
        config = {"heldout_size": len(held), "heldout_hash": tasks.dataset_hash(held).hex()}
    return fields, config


def load_problems(spec: str, size: int, seed: int) -> list[Any]:
    from node.rl import tasks

    if spec.startswith("builtin:"):
        try:
            problems = tasks.builtin_problems(spec.removeprefix("builtin:"), size, seed)
        except ValueError as exc:
            raise ModelError(f"dataset {spec}: {exc}") from None
    else:
        problems = tasks.load_dataset(spec)
    if len(problems) != size:
        raise ModelError(f"dataset {spec} has {len(problems)} problems, the genesis says {size}")
    return problems
