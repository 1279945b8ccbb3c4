"""The few patches that let megatron-core 0.19.2 train on CPU over gloo.

    import megatron_patches; megatron_patches.apply()   # before building any Megatron model

Each patch fixes one obstacle listed in shared/ENVIRONMENT.md and says why in one line.
`apply()` is a no-op where CUDA is present: on GPU Megatron runs untouched.
tests/test_megatron_patches.py checks, for every patch, that Megatron still fails without it
(so a patch that an upgrade made unnecessary is noticed) and works with it.
"""
import contextlib
import functools

import torch

PATCHES = {}  # name -> function that installs it; filled by @_patch in definition order
_applied: list[str] = []
_skipped: set[str] = set()  # tests leave a patch out to show it is still needed


def _patch(fn):
    PATCHES[fn.__name__] = fn
    return fn


@_patch
def current_device():
    """~200 Megatron call sites pass `device=torch.cuda.current_device()`: answer "cpu"."""
    torch.cuda.current_device = lambda: "cpu"


@_patch
def rng_tracker():
    """The model-parallel RNG tracker keeps CUDA generator states: keep CPU ones instead."""
    from megatron.core.tensor_parallel import random

    class CPURNGStatesTracker(random.CudaRNGStatesTracker):
        def add(self, name, seed):
            if seed in self.seeds_ or name in self.states_:
                raise ValueError(f"rng state {name!r} or seed {seed} already tracked")
            self.seeds_.add(seed)
            saved = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(saved)

        @contextlib.contextmanager
        def fork(self, name=random._MODEL_PARALLEL_RNG_TRACKER_NAME):
            saved = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(saved)

    random.CudaRNGStatesTracker = CPURNGStatesTracker
    random._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    random._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
    random.initialize_rng_tracker(force_reset=True)


_CPU_TO_CUDA_TYPE = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
}


class _CudaToCPU(torch.overrides.TorchFunctionMode):
    """Rewrites `device="cuda"` in tensor factories to the CPU, and answers `t.type()` with the
    CUDA type name that Megatron's optimizer asserts on."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs["device"] = "cpu"
        result = func(*args, **kwargs)
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return _CPU_TO_CUDA_TYPE.get(result, result)
        return result


_mode_depth = 0


def _on_cpu(fn):
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        global _mode_depth
        if _mode_depth:
            return fn(*args, **kwargs)
        _mode_depth += 1
        try:
            with _CudaToCPU():
                return fn(*args, **kwargs)
        finally:
            _mode_depth -= 1

    return wrapped


@_patch
def schedules_on_cpu():
    """Pipeline schedules and the default causal mask allocate with `device="cuda"`: map to CPU."""
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.transformer import utils

    for name in (
        "forward_backward_no_pipelining",
        "forward_backward_pipelining_without_interleaving",
        "forward_backward_pipelining_with_interleaving",
    ):
        setattr(schedules, name, _on_cpu(getattr(schedules, name)))
    utils.get_default_causal_mask = _on_cpu(utils.get_default_causal_mask)


class _NullStream:
    """Stands in for a CUDA stream where CPU ops are already ordered."""

    def wait_stream(self, other):
        pass

    def synchronize(self):
        pass

    def record_event(self, event=None):
        return None


@_patch
def optimizer_on_cpu():
    """Megatron's optimizers allocate flags and scales on "cuda" and assert CUDA tensor types."""
    from megatron.core.optimizer import distrib_optimizer, optimizer

    classes = (
        optimizer.MegatronOptimizer,
        optimizer.MixedPrecisionOptimizer,
        optimizer.Float16OptimizerWithFloat16Params,
        optimizer.FP32Optimizer,
        optimizer.ChainedOptimizer,
        distrib_optimizer.DistributedOptimizer,
    )
    for cls in classes:
        for name, attr in list(vars(cls).items()):
            if name.startswith("__") and name != "__init__":
                continue
            if isinstance(attr, (staticmethod, classmethod)):
                setattr(cls, name, type(attr)(_on_cpu(attr.__func__)))
            elif callable(attr) and not isinstance(attr, type):
                setattr(cls, name, _on_cpu(attr))


@_patch
def streams():
    """Megatron DDP orders gradient reductions on CUDA streams; CPU ops are already in order."""
    torch.cuda.current_stream = lambda device=None: _NullStream()
    torch.cuda.stream = lambda stream: contextlib.nullcontext()


@contextlib.contextmanager
def _tensor_cuda_is_identity():
    cuda = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    try:
        yield
    finally:
        torch.Tensor.cuda = cuda


@_patch
def tied_embedding_init():
    """With PP and tied embeddings, the LM-head copy is synced after a `.cuda()`: keep it on CPU."""
    from megatron.core.models.common.language_module.language_module import LanguageModule

    setup = LanguageModule.setup_embeddings_and_output_layer

    @functools.wraps(setup)
    def setup_on_cpu(self):
        with _tensor_cuda_is_identity():
            return setup(self)

    LanguageModule.setup_embeddings_and_output_layer = setup_on_cpu


@_patch
def variable_pipeline_shapes():
    """With `variable_seq_lengths` (micro-batches of different shapes under PP) the stages first
    exchange shapes, then call `torch.cuda.synchronize()`: gloo's requests were already waited on."""
    from megatron.core.pipeline_parallel import p2p_communication

    cls = p2p_communication.P2PCommunicator
    exchange = cls._communicate_shapes

    @functools.wraps(exchange)
    def exchange_on_cpu(self, *args, **kwargs):
        synchronize = torch.cuda.synchronize
        torch.cuda.synchronize = lambda device=None: None
        try:
            return exchange(self, *args, **kwargs)
        finally:
            torch.cuda.synchronize = synchronize

    cls._communicate_shapes = exchange_on_cpu


@_patch
def checkpoint_preload():
    """dist_checkpointing's writer copies tensors to the host without blocking, then waits with
    `torch.cuda.synchronize()`: on CPU the copy is already done, so copy blocking."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    preload = FileSystemWriterAsync.preload_tensors
    FileSystemWriterAsync.preload_tensors = staticmethod(
        functools.wraps(preload)(lambda buckets, non_blocking=True: preload(buckets, non_blocking=False)))


# The three below mend the distributed optimizer's checkpoints where it steps torch's own Adam
# (no TE or Apex: CPU). torch's Adam keeps a `step` tensor per parameter; TE's keeps it per group.
@_patch
def optimizer_state_before_first_step():
    """`state_dict()` (which loading a checkpoint calls first) asserts one `step` among the Adam
    states, and there are none before the first step: allocate them as a load would, zeroed."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    state_dict = DistributedOptimizer.state_dict

    @functools.wraps(state_dict)
    def with_states(self):
        if not self.optimizer.state:
            groups = [{k: v for k, v in g.items() if k != "params"} | {"step": 0} for g in self.optimizer.param_groups]
            self.load_state_dict({"optimizer": {"param_groups": groups}})
            for state in self.optimizer.state.values():
                for value in state.values():
                    value.zero_()
        return state_dict(self)

    DistributedOptimizer.state_dict = with_states


@_patch
def optimizer_step_kept_aside():
    """Loading copies each checkpointed state into the live one of the same name. torch Adam's
    `step` is one of them, and the checkpoint keeps it in its param groups (set before this):
    `fully_reshardable` holds no `step` (KeyError), `dp_reshardable` a stale one. Skip it."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    set_states = DistributedOptimizer._set_main_param_and_optimizer_states

    @functools.wraps(set_states)
    def without_step(self, model_param, tensors):
        return set_states(self, model_param, tensors | {"step": None})

    DistributedOptimizer._set_main_param_and_optimizer_states = without_step


@_patch
def optimizer_step_per_parameter():
    """`load_state_dict` gives every parameter one shared `step` tensor, which torch's Adam then
    increments once per parameter at each step: give each parameter its own."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    load_state_dict = DistributedOptimizer.load_state_dict

    @functools.wraps(load_state_dict)
    def own_steps(self, state_dict):
        load_state_dict(self, state_dict)
        for state in self.optimizer.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()

    DistributedOptimizer.load_state_dict = own_steps


@_patch
def alltoall_dispatcher():
    """The all-to-all token dispatcher copies its split sizes to the host on a CUDA stream it
    creates when first built: on CPU they are host tensors already, which it hands to
    all_to_all_single as they are (a TypeError): make them the numpy arrays its GPU path makes."""
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = _NullStream()  # built only while None

    def splits_on_host(self, point, tokens_per_expert=None):
        if not self.drop_and_pad and point == self.cuda_dtoh_point:
            for name in ("input_splits", "output_splits", "output_splits_tp"):
                if torch.is_tensor(getattr(self, name)):
                    setattr(self, name, getattr(self, name).numpy())
        return tokens_per_expert

    MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize = splits_on_host


@_patch
def gated_delta_net_in_torch():
    """Megatron's Gated DeltaNet refuses to build without flash-linear-attention (Triton kernels, GPU
    only), though `deterministic_mode` runs its torch path; that path still L2-normalises q and k
    with fla's `l2norm`: give it torch's x / sqrt(Σx² + ε), ε = 1e-6 as fla's and transformers'."""
    from megatron.core.ssm.gated_delta_net import common

    def l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6) -> torch.Tensor:
        return x * torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)

    common.HAVE_FLA = True
    common.l2norm = l2norm


@_patch
def eager_fusions():
    """Megatron's `jit_fuser` compiles a few element-wise functions (the Gated DeltaNet's gates and
    norm, the attention's output gate) with torch.compile: on CPU that builds C++ at run time in
    every worker (seconds each; a compiler needed), and with AVX2 kernels its code gave NaN. Run
    them eagerly, as written."""
    torch._dynamo.config.disable = True


def apply(skip: tuple[str, ...] = ()) -> list[str]:
    """Installs every patch once; returns the names applied. `skip` (for tests) leaves patches
    out for the rest of the process."""
    if torch.cuda.is_available():
        return []
    _skipped.update(skip)
    for name, install in PATCHES.items():
        if name not in _skipped and name not in _applied:
            install()
            _applied.append(name)
    return list(_applied)
