"""Checkpoint conversion between HF directories and orz's Megatron layout, for any TP, PP, EP, ETP.

    python -m orz.convert hf2mcore --hf Qwen2.5-7B --out ckpt/mcore --tp 4 --pp 2
    python -m orz.convert hf2mcore --hf Qwen3-30B-A3B --out ckpt/mcore --tp 2 --ep 8
    python -m orz.convert mcore2hf --mcore ckpt/mcore --out ckpt/hf [--like Qwen2.5-7B]
    python -m orz.convert verify --hf Qwen2.5-7B --tp 2 --pp 2     # one JSON line

A Megatron directory holds `mp_rank_TT_PPP/model.safetensors` per TP × PP rank, for a MoE
`expert_rank_EEE_TT_PPP/model.safetensors` per EP × ETP × PP rank of the experts, and
`orz_megatron.json` (the HF config, TP, PP, EP, ETP, padded vocabulary). Offline conversion needs
no distributed setup. `verify` starts the smallest local world where ep·etp divides tp·dp, loads
the HF weights into Megatron, and reports the largest absolute logit difference against the
transformers forward on the same tokens.
"""
import argparse
import json
import math
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import save_file

from orz.models.arch import ModelConfigError
from orz.models.checkpoint import (
    MEGATRON_META,
    HFCheckpoint,
    atomic_dir,
    expert_file,
    load_rank_state,
    megatron_meta,
    rank_file,
    read_megatron_meta,
    save_hf,
)
from orz.models.convert import Layout, megatron_to_hf, param_rules, to_megatron


def hf2mcore(hf_dir: str, out_dir: str, tp: int, pp: int, vocab_divisible_by: int = 1, ep: int = 1,
             etp: int = 1) -> Path:
    ckpt = HFCheckpoint(hf_dir)
    ckpt.arch.check_parallel(tp, pp, ep, etp)
    padded = ckpt.arch.padded_vocab_size(tp, vocab_divisible_by)
    whole = Layout(tp, pp, padded_vocab=padded, ep=ep, etp=etp)
    with atomic_dir(out_dir) as tmp:
        for pp_rank in range(pp):
            ranks = [(False, replace(whole, tp_rank=t, pp_rank=pp_rank)) for t in range(tp)]
            if ckpt.arch.moe:
                ranks += [(True, replace(whole, pp_rank=pp_rank, ep_rank=e, etp_rank=t))
                          for e in range(ep) for t in range(etp)]
            for experts, layout in ranks:
                rules = [r for r in param_rules(ckpt.arch, layout) if r.expert == experts]
                state = {r.megatron: to_megatron(r, [ckpt.get(n) for n in r.hf], ckpt.arch, layout) for r in rules}
                file = tmp / (expert_file(layout) if experts else rank_file(layout))
                file.parent.mkdir(parents=True)
                save_file(state, file, metadata={"format": "pt"})
        (tmp / MEGATRON_META).write_text(json.dumps(megatron_meta(ckpt.config, whole), indent=2))
    return Path(out_dir)


def mcore2hf(mcore_dir: str, out_dir: str, like: str | None = None) -> Path:
    """Writes a complete HF directory; `like` (an HF dir) supplies tokenizer and other files."""
    config, arch, layout = read_megatron_meta(mcore_dir)
    cache = {}

    def shards(tp_rank, pp_rank):
        return _cached(("tp", tp_rank, pp_rank), lambda: load_rank_state(
            mcore_dir, replace(layout, tp_rank=tp_rank, pp_rank=pp_rank)))

    def expert_shards(ep_rank, etp_rank, pp_rank):
        return _cached(("ep", ep_rank, etp_rank, pp_rank), lambda: load_rank_state(
            mcore_dir, replace(layout, pp_rank=pp_rank, ep_rank=ep_rank, etp_rank=etp_rank), experts=True))

    def _cached(key, load):  # key[-1]: the stage
        if key not in cache:
            if any(k[-1] != key[-1] for k in cache):
                cache.clear()  # one stage at a time: never hold the whole model twice
            cache[key] = load()
        return cache[key]

    return save_hf(out_dir, megatron_to_hf(shards, arch, layout, expert_shards), config, extra_files_from=like)


def _verify_rank(rank, world, hf_dir, tp, pp, ep, etp, tokens):
    from orz.models.megatron_engine import ModelEngine
    from orz.models.parallel import init_model_parallel

    init_model_parallel(tp, pp, ep=ep, etp=etp)
    ckpt = HFCheckpoint(hf_dir)
    engine = ModelEngine(ckpt.arch)
    engine.load_hf(ckpt)
    return engine.full_logits(tokens)


def verify(hf_dir: str, tp: int, pp: int, batch: int = 2, seq: int = 32, seed: int = 0, ep: int = 1,
           etp: int = 1) -> dict:
    from transformers import AutoModelForCausalLM

    from orz.models.local_world import run_world

    ckpt = HFCheckpoint(hf_dir)
    ckpt.arch.check_parallel(tp, pp, ep, etp)
    dp = math.lcm(tp, ep * etp) // tp  # the smallest DP with ep·etp dividing tp·dp
    tokens = torch.randint(0, ckpt.arch.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed))
    start = time.time()
    ranks = run_world(_verify_rank, tp * pp * dp, hf_dir, tp, pp, ep, etp, tokens)
    logits = next(r for r in ranks if r is not None)
    with torch.no_grad():
        reference = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=logits.dtype)(tokens).logits
    return {
        "hf": str(hf_dir), "tp": tp, "pp": pp, "ep": ep, "etp": etp, "dp": dp, "tokens": list(tokens.shape), "dtype": str(logits.dtype),
        "max_abs_logit_diff": (logits.float() - reference.float()).abs().max().item(),
        "seconds": round(time.time() - start, 2),
    }


def _expert_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ep", type=int, default=1, help="expert parallel size (MoE): divides the experts")
    parser.add_argument("--etp", type=int, default=1, help="expert tensor parallel size (MoE)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m orz.convert", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("hf2mcore", help="HF directory -> Megatron shards")
    p.add_argument("--hf", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--vocab-divisible-by", type=int, default=1, help="pad vocab to a multiple of this × TP")
    _expert_args(p)
    p = sub.add_parser("mcore2hf", help="Megatron shards -> HF directory")
    p.add_argument("--mcore", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--like", help="HF directory to copy tokenizer files from")
    p = sub.add_parser("verify", help="logits of Megatron(TP, PP) vs transformers, as JSON")
    p.add_argument("--hf", required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    _expert_args(p)
    args = parser.parse_args(argv)
    try:
        if args.command == "hf2mcore":
            print(hf2mcore(args.hf, args.out, args.tp, args.pp, args.vocab_divisible_by, args.ep, args.etp))
        elif args.command == "mcore2hf":
            print(mcore2hf(args.mcore, args.out, args.like))
        else:
            print(json.dumps(verify(args.hf, args.tp, args.pp, ep=args.ep, etp=args.etp)))
    except ModelConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
