"""Moving the actor's weights (HF names) from the trainer's rank 0 into every vLLM worker.

Two transports, one stream format — a sequence of (hf_name, tensor) in which every fused vLLM
layer (q/k/v, gate/up) arrives within one reload, as vLLM requires:

- collective (default): a broadcast over a process group spanning trainer rank 0 and all
  engine workers (gloo on CPU, NCCL on GPU). Tensors are packed into size-bounded buckets in a
  reused staging buffer; each bucket is preceded by a small header (names, dtypes, shapes).
- object store (fallback): the same buckets as Ray objects, fetched by each engine.

Every sync carries a version. Digests (blake3 of the raw bytes) of what was sent can be
compared with what each engine received and with what it holds afterwards.
"""
import pickle
import warnings
from dataclasses import dataclass
from typing import Iterable, Iterator

import blake3
import torch

from orz.exp_engine.parallels.orz_distributed_c10d import broadcast

DEFAULT_BUCKET_BYTES = 64 << 20
_HEADER = 3  # int64: [meta bytes, data bytes, last]


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


def _pack(bucket: list[tuple[str, torch.Tensor]], staging: torch.Tensor) -> tuple[list[TensorMeta], torch.Tensor]:
    metas, offset = [], 0
    total = sum(t.numel() * t.element_size() for _, t in bucket)
    if staging.numel() < total:
        staging.resize_(total)
    for name, tensor in bucket:
        nbytes = tensor.numel() * tensor.element_size()
        staging[offset : offset + nbytes].copy_(tensor.detach().contiguous().reshape(-1).view(torch.uint8))
        metas.append(TensorMeta(name, tensor.dtype, tuple(tensor.shape), offset, nbytes))
        offset += nbytes
    return metas, staging[:total]


def _unpack(metas: list[TensorMeta], data: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """Copies out of the (reused) bucket: vLLM may keep a layer's tensors until the layer is complete."""
    for m in metas:
        yield m.name, data[m.offset : m.offset + m.nbytes].view(m.dtype).reshape(m.shape).clone()


def new_staging() -> torch.Tensor:
    """A bucket buffer; keep it across syncs (fresh large buffers cost page faults every time)."""
    return torch.empty(0, dtype=torch.uint8)


def send_broadcast(group, named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int, staging: torch.Tensor,
                   with_digests: bool = True) -> dict[str, str]:
    """Trainer rank 0's side (group rank 0): broadcasts every tensor, bucket by bucket; returns
    the digests of what was sent, by name (empty unless `with_digests`)."""
    sent = {}
    for bucket in buckets(named, bucket_bytes):
        metas, data = _pack(bucket, staging)
        meta_bytes = torch.frombuffer(bytearray(pickle.dumps(metas)), dtype=torch.uint8)
        broadcast(group, torch.tensor([meta_bytes.numel(), data.numel(), 0]))
        broadcast(group, meta_bytes)
        broadcast(group, data)
        if with_digests:
            sent.update((name, digest(t)) for name, t in bucket)
    broadcast(group, torch.tensor([0, 0, 1]))
    return sent


def receive_broadcast(group, staging: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """An engine worker's side: yields the tensors of one sync as they arrive."""
    while True:
        header = torch.empty(_HEADER, dtype=torch.int64)
        broadcast(group, header)
        meta_len, data_len, last = header.tolist()
        if last:
            return
        meta_bytes = torch.empty(meta_len, dtype=torch.uint8)
        broadcast(group, meta_bytes)
        if staging.numel() < data_len:
            staging.resize_(data_len)
        data = staging[:data_len]
        broadcast(group, data)
        yield from _unpack(pickle.loads(meta_bytes.numpy().tobytes()), data)


def to_object_store_buckets(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                            with_digests: bool = True):
    """The fallback transport: one Ray object per bucket, as numpy bytes (zero-copy in Ray;
    bfloat16 has no numpy dtype, so bytes it is). Returns (object refs, digests)."""
    import ray

    refs, sent, staging = [], {}, new_staging()
    for bucket in buckets(named, bucket_bytes):
        metas, data = _pack(bucket, staging)
        refs.append(ray.put((metas, data.numpy())))  # ray.put copies: the staging buffer is reused
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
