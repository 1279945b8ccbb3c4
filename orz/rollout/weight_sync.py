"""Moving the actor's weights (HF names) from the trainer's rank 0 into every vLLM worker.

Two transports, one stream format — a sequence of (hf_name, tensor) in which every fused vLLM
layer (q/k/v, gate/up) arrives within one reload, as vLLM requires:

- collective (default): a broadcast over a process group spanning trainer rank 0 and all
  engine workers (gloo on CPU, NCCL on GPU). Tensors are packed into size-bounded buckets in a
  reused staging buffer; each bucket is preceded by a small header (names, dtypes, shapes). An
  engine worker on CPU receives each bucket of a sync into a buffer of its own, kept across
  syncs, in a thread: the next buckets arrive while vLLM loads this one, and tensors reach vLLM
  as views, never copied. On GPU (where a second copy of the model does not fit) one buffer is
  reused and tensors are cloned out of it.
- object store (fallback): the same buckets as Ray objects, fetched by each engine.

Every sync carries a version. Digests (blake3 of the raw bytes) of what was sent can be
compared with what each engine received and with what it holds afterwards.

One module, in the order a sync runs: the process group, the stream (buckets, headers, digests),
the sender and the receiving side, and the sources the fleet syncs from (WeightSource: the
actor's GroupSource, or a TensorSource). EngineFleet.sync drives it; the engine's worker
extension loads what arrives.
"""
import itertools
import pickle
import queue
import threading
import warnings
from dataclasses import dataclass
from datetime import timedelta
from typing import Iterable, Iterator, Protocol

import blake3
import ray
import torch
import torch.distributed as dist

from orz.models.parallel import host_store

DEFAULT_BUCKET_BYTES = 64 << 20
_HEADER = 3  # int64: [meta bytes, data bytes, last]


# ---- the process group: trainer rank 0 and every engine worker ---------------------------------
# It touches neither side's default torch.distributed group: it is built directly on rank 0's
# TCPStore (orz.models.parallel.host_store) wrapped in a PrefixStore, since torch's `new_group`
# would need every member in one default world. Construction blocks until all `world_size`
# members have joined, so the caller starts the others first (a Ray call that does not wait) and
# then joins itself.
#
#     store = host_store(ip)                                          # rank 0, first
#     group = init_custom_process_group("gloo", store, 0, world_size, "weights-v3")
#     group = init_custom_process_group("gloo", join_store(ip, store.port), rank, world_size, "weights-v3")


def init_custom_process_group(
    backend: str,
    store: dist.Store,
    rank: int,
    world_size: int,
    group_name: str,
    timeout_s: float = 300.0,
) -> dist.ProcessGroup:
    timeout = timedelta(seconds=timeout_s)
    store = dist.PrefixStore(group_name, store)
    if backend == "gloo":
        group = dist.ProcessGroupGloo(store, rank, world_size, timeout)
    elif backend == "nccl":  # untested here: no GPU
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        group = dist.ProcessGroupNCCL(store, rank, world_size, options)
    else:
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    return group


def broadcast(group: dist.ProcessGroup, tensor: torch.Tensor, src: int = 0) -> None:
    """In-place broadcast from group rank `src` over a group made above."""
    opts = dist.BroadcastOptions()
    opts.rootRank = src
    group.broadcast([tensor], opts).wait()


def destroy(group: dist.ProcessGroup) -> None:
    """Releases the group's connections (an abort at exit was seen without it)."""
    shutdown = getattr(group, "shutdown", None)
    if shutdown is not None:
        shutdown()


def digest(tensor: torch.Tensor) -> str:
    """blake3 of a tensor's raw bytes (any dtype, bfloat16 included)."""
    raw = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
    return blake3.blake3(raw).hexdigest()


@dataclass(frozen=True)
class TensorMeta:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # byte offset in the bucket
    nbytes: int


def as_engines_hold(named: Iterable[tuple[str, torch.Tensor]], dtype: str) -> Iterator[tuple[str, torch.Tensor]]:
    """The weights in the engines' dtype (rollout.engine_dtype; bf16 engines of an fp32 actor: half
    the bytes, and digests of what the engines hold). vLLM keeps a Gated DeltaNet's A_log in float32
    whatever its dtype: sent as it is."""
    to = getattr(torch, dtype)
    return ((name, tensor if name.endswith(".A_log") else tensor.to(to)) for name, tensor in named)


def buckets(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Groups a stream of tensors into lists of at most `bucket_bytes` (a bigger tensor travels alone)."""
    bucket, size = [], 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def _grown(buffer: torch.Tensor, nbytes: int) -> torch.Tensor:
    """The first nbytes of buffer, grown in place to hold them."""
    if buffer.numel() < nbytes:
        buffer.resize_(nbytes)
    return buffer[:nbytes]


def _pack(bucket: list[tuple[str, torch.Tensor]], staging: torch.Tensor) -> tuple[list[TensorMeta], torch.Tensor]:
    metas, offset = [], 0
    data = _grown(staging, sum(t.numel() * t.element_size() for _, t in bucket))
    for name, tensor in bucket:
        nbytes = tensor.numel() * tensor.element_size()
        data[offset : offset + nbytes].copy_(tensor.detach().contiguous().reshape(-1).view(torch.uint8))
        metas.append(TensorMeta(name, tensor.dtype, tuple(tensor.shape), offset, nbytes))
        offset += nbytes
    return metas, data


def _unpack(metas: list[TensorMeta], data: torch.Tensor, copy: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """The bucket's tensors; copied (`copy`) when the bucket will be reused within the sync: vLLM
    may keep a layer's tensors until the layer is complete."""
    for m in metas:
        tensor = data[m.offset : m.offset + m.nbytes].view(m.dtype).reshape(m.shape)
        yield m.name, tensor.clone() if copy else tensor


def new_staging(device: torch.device | str = "cpu") -> torch.Tensor:
    """A bucket buffer; keep it across syncs (fresh large buffers cost page faults every time)."""
    return torch.empty(0, dtype=torch.uint8, device=device)


class ReceiveBuffers:
    """An engine worker's receive buffers, kept across syncs. per_bucket (CPU): one buffer per
    bucket of a sync, so that received tensors stay valid until the sync ends; otherwise one."""

    def __init__(self, device: torch.device | str = "cpu", per_bucket: bool = True):
        self.device, self.per_bucket = torch.device(device), per_bucket
        self.buffers: list[torch.Tensor] = []

    def get(self, index: int, nbytes: int) -> torch.Tensor:
        index = index if self.per_bucket else 0
        while len(self.buffers) <= index:
            self.buffers.append(new_staging(self.device))
        return _grown(self.buffers[index], nbytes)


def send_broadcast(group, named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int, staging: torch.Tensor,
                   with_digests: bool = True) -> dict[str, str]:
    """Trainer rank 0's side (group rank 0): broadcasts every tensor, bucket by bucket; returns
    the digests of what was sent, by name (empty unless `with_digests`)."""
    sent, device = {}, staging.device
    for bucket in buckets(named, bucket_bytes):
        metas, data = _pack(bucket, staging)
        meta_bytes = torch.frombuffer(bytearray(pickle.dumps(metas)), dtype=torch.uint8).to(device)
        broadcast(group, torch.tensor([meta_bytes.numel(), data.numel(), 0], device=device))
        broadcast(group, meta_bytes)
        broadcast(group, data)
        if with_digests:
            sent.update((name, digest(t)) for name, t in bucket)
    broadcast(group, torch.tensor([0, 0, 1], device=device))
    return sent


def _receive_buckets(group, buffers: ReceiveBuffers) -> Iterator[tuple[list[TensorMeta], torch.Tensor]]:
    """(metas, data) of each bucket of one sync, data in the bucket's receive buffer."""
    for index in itertools.count():
        header = torch.empty(_HEADER, dtype=torch.int64, device=buffers.device)
        broadcast(group, header)
        meta_len, data_len, last = header.tolist()
        if last:
            return
        meta_bytes = torch.empty(meta_len, dtype=torch.uint8, device=buffers.device)
        broadcast(group, meta_bytes)
        data = buffers.get(index, data_len)
        broadcast(group, data)
        yield pickle.loads(meta_bytes.cpu().numpy().tobytes()), data


def receive_broadcast(group, buffers: ReceiveBuffers) -> Iterator[tuple[str, torch.Tensor]]:
    """An engine worker's side: yields the tensors of one sync as they arrive."""
    if not buffers.per_bucket:
        for metas, data in _receive_buckets(group, buffers):
            yield from _unpack(metas, data, copy=True)
        return
    arrived = queue.SimpleQueue()  # (metas, data), then None; or the receiving thread's exception

    def receive():
        try:
            for bucket in _receive_buckets(group, buffers):
                arrived.put(bucket)
            arrived.put(None)
        except BaseException as err:  # noqa: BLE001 - re-raised in the consumer below
            arrived.put(err)

    thread = threading.Thread(target=receive, name="orz-weight-receive", daemon=True)
    thread.start()
    while (bucket := arrived.get()) is not None:
        if isinstance(bucket, BaseException):
            raise bucket
        yield from _unpack(*bucket, copy=False)
    thread.join()


def to_object_store_buckets(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                            with_digests: bool = True):
    """The fallback transport: one Ray object per bucket, as numpy bytes (zero-copy in Ray;
    bfloat16 has no numpy dtype, so bytes it is). Returns (object refs, digests)."""
    import ray

    refs, sent = [], {}
    for bucket in buckets(named, bucket_bytes):
        # A fresh buffer each time: .numpy() leaves a tensor's storage unable to grow.
        metas, data = _pack(bucket, new_staging())
        refs.append(ray.put((metas, data.numpy())))
        if with_digests:
            sent.update((name, digest(t)) for name, t in bucket)
    return refs, sent


def receive_object_store(refs) -> Iterator[tuple[str, torch.Tensor]]:
    import ray

    for ref in refs:
        metas, data = ray.get(ref)
        with warnings.catch_warnings():  # Ray's buffers are read-only; _unpack only reads them
            warnings.simplefilter("ignore", UserWarning)
            data = torch.from_numpy(data)
        yield from _unpack(metas, data)


@dataclass(frozen=True)
class GroupSpec:
    backend: str
    master_addr: str
    master_port: int
    world_size: int
    group_name: str
    timeout_s: float = 600.0  # a broadcast that does not complete by then raises, on every member


class BroadcastSender:
    """The source side of collective syncs (the actor's rank 0, or a TensorSource): hosts the
    rendezvous of each group the fleet makes, joins it as its rank 0 once and keeps it (on GPU,
    an NCCL communicator is seconds to build) until the fleet makes a new one."""

    def __init__(self):
        self.spec: GroupSpec | None = None
        self.group = None
        self.store: dist.TCPStore | None = None  # the newest group's rendezvous

    def host(self) -> tuple[str, int]:
        """Starts a new group's rendezvous: (this node's IP, its port)."""
        ip = ray.util.get_node_ip_address()
        self.store = host_store(ip)
        return ip, self.store.port

    def send(self, spec: GroupSpec, named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int,
             staging: torch.Tensor, with_digests: bool) -> dict[str, str]:
        if spec != self.spec:
            self.close()
            if self.store is None or self.store.port != spec.master_port:
                raise RuntimeError(f"weight group {spec.group_name} is not at a rendezvous this sender hosts")
            self.group = init_custom_process_group(spec.backend, self.store, 0, spec.world_size, spec.group_name,
                                                   spec.timeout_s)
            self.spec = spec
        try:
            return send_broadcast(self.group, named, bucket_bytes, staging, with_digests)
        except Exception:  # a member timed out or died: this group is spent
            self.close()
            raise

    def close(self) -> None:
        group, self.spec, self.group = self.group, None, None
        if group is not None:
            destroy(group)


# ---- sources: what the fleet syncs from -------------------------------------------------------


class WeightSource(Protocol):
    def host_group(self) -> tuple[str, int]:
        """Starts the rendezvous of a new group with the source as rank 0: (ip, port)."""

    def send(self, spec: GroupSpec, bucket_bytes: int, with_digests: bool) -> dict[str, str]:
        """Joins the group as rank 0, broadcasts all weights, returns their digests (if asked)."""

    def put(self, bucket_bytes: int, with_digests: bool) -> tuple[list, dict[str, str]]:
        """Puts all weights into the object store: (bucket refs, digests)."""


class TensorSource:
    """A WeightSource over tensors in this process (tests, benchmarks, a single-process trainer)."""

    def __init__(self, named: dict[str, torch.Tensor]):
        self.named = named
        self.staging = new_staging()
        self.sender = BroadcastSender()

    def host_group(self):
        return self.sender.host()

    def send(self, spec, bucket_bytes, with_digests):
        return self.sender.send(spec, self.named.items(), bucket_bytes, self.staging, with_digests)

    def put(self, bucket_bytes, with_digests):
        return to_object_store_buckets(self.named.items(), bucket_bytes, with_digests)


class GroupSource:
    """A trainer role's worker group (the actor's: orz.ppo.workers.WorkerGroup) as a WeightSource:
    its rank 0 broadcasts (or puts) the weights that all of its ranks gather from their shards."""

    def __init__(self, group):
        self.group = group

    def host_group(self):
        return self.group.host_weight_group()

    def send(self, spec, bucket_bytes, with_digests):
        return self.group.send_weights(spec, bucket_bytes, with_digests)

    def put(self, bucket_bytes, with_digests):
        return self.group.put_weights(bucket_bytes, with_digests)
