"""Checkpoint conversion between HF directories and Megatron's format (the one orz's trainer writes;
`model.path` of a run and `orz eval --model` read hf2mcore's output too).

    orz convert hf2mcore --hf Qwen2.5-7B --out ckpt/mcore --tp 4 --pp 2
    orz convert mcore2hf --mcore runs/x/checkpoints/iter_000300/actor --out hf   # tokenizer from runs/x/hf_files
    orz convert upgrade runs/x/checkpoints/iter_000300     # a checkpoint orz wrote before 2026-12-05
    orz convert verify --hf Qwen2.5-7B --tp 2 --pp 2       # one JSON line

A Megatron directory is Megatron's dist_checkpointing (torch_dist) plus orz_checkpoint.json (the
HF config, the layout it was saved at, the model's dtype): orz/models/dist_checkpoint.py. It loads
at any TP/PP/EP/ETP (with the same padded vocabulary), so `--tp`/`--pp` of hf2mcore only say how
many local processes load the HF weights and pad the vocabulary. mcore2hf reads any such
directory, a trainer checkpoint's role included, in one process, and writes the model's weights
in the model's dtype (what `trainer.export_hf` writes). `verify` starts the smallest local world
where ep·etp divides tp·dp, loads the HF weights into Megatron, and reports the largest absolute
logit difference against the transformers forward on the same tokens.
"""
import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from orz.config import ConfigError, ExperimentConfig, from_dict
from orz.models.arch import ModelConfigError, arch_from_dict
from orz.models.checkpoint import (
    HF_FILES,
    UNTRAINED,
    HFCheckpoint,
    atomic_dir,
    copy_hf_files,
    is_earlier_format,
    kept_hf_files,
    read_megatron_meta,
    require_untrained_source,
    save_hf,
    weights_fingerprint,
    with_untrained,
)
from orz.models.convert import Layout, param_rules
from orz.models.local_world import run_world
from orz.models.spec import LoraSpec, ModelSpec, Sizes, smallest_dp

ROLES_WITH_CHECKPOINTS = ("actor", "critic")


def _hf2mcore_rank(rank, world, hf_dir, out, tp, pp, ep, etp, vocab_divisible_by):
    from orz.models import dist_checkpoint
    from orz.models.megatron_model import MegatronModel
    from orz.models.parallel import init_model_parallel

    sizes = Sizes(tp=tp, pp=pp, ep=ep, etp=etp)
    init_model_parallel(sizes)
    ckpt = HFCheckpoint(hf_dir)
    dtype = ckpt.config.get("torch_dtype") if ckpt.config.get("torch_dtype") in ("bfloat16", "float16") else "float32"
    model = MegatronModel(ckpt.arch, ModelSpec(sizes=sizes, dtype=dtype, vocab_divisible_by=vocab_divisible_by))
    model.load_hf(ckpt)
    dist_checkpoint.save(model, out, {}, ckpt.config)


def hf2mcore(hf_dir: str, out_dir: str, tp: int = 1, pp: int = 1, vocab_divisible_by: int = 1, ep: int = 1,
             etp: int = 1) -> Path:
    """The HF weights in Megatron's format, weights only, in the checkpoint's dtype."""
    ckpt = HFCheckpoint(hf_dir)
    ckpt.arch.check_parallel(tp, pp, ep, etp)
    whole = Layout(padded_vocab=ckpt.arch.padded_vocab_size(tp, vocab_divisible_by))
    ckpt.require(name for rule in param_rules(ckpt.arch, whole) for name in rule.hf)  # before any process starts
    with atomic_dir(out_dir) as tmp:
        run_world(_hf2mcore_rank, tp * pp * smallest_dp(tp, ep, etp), hf_dir, str(tmp), tp, pp, ep, etp,
                  vocab_divisible_by, timeout=3600)
        (tmp / HF_FILES).mkdir()
        copy_hf_files(hf_dir, tmp / HF_FILES)
        untrained = dict(ckpt.untrained({name for rule in param_rules(ckpt.arch, whole) for name in rule.hf}))
        if untrained:  # a wrapper's vision tower and MTP layers, for mcore2hf's way back
            save_file(untrained, tmp / HF_FILES / UNTRAINED, metadata={"format": "pt"})
    return Path(out_dir)


def _mcore2hf_rank(rank, world, mcore_dir, out_dir, like, merged):
    from orz.models import dist_checkpoint
    from orz.models.megatron_model import MegatronModel
    from orz.models.parallel import init_model_parallel
    from orz.models.peft_format import adapter_config, write_adapter

    meta = read_megatron_meta(mcore_dir)
    init_model_parallel()
    lora = LoraSpec(**(meta["lora"] | {"targets": tuple(meta["lora"]["targets"])})) if "lora" in meta else None
    # The saved vocabulary padding (a multiple of itself at TP 1), so that every shape matches.
    model = MegatronModel(arch_from_dict(meta["hf_config"], Path(mcore_dir)),
                          ModelSpec(dtype=meta["dtype"], vocab_divisible_by=meta["padded_vocab"], lora=lora))
    if lora is not None:  # the adapters' checkpoint holds them alone: the base is its HF directory's
        model.load_hf(HFCheckpoint(meta["lora_base"]["path"]))
    dist_checkpoint.load(model, mcore_dir, with_optimizer=False)
    if lora is not None and not merged:
        return str(write_adapter(out_dir, model.adapter_tensors(), adapter_config(lora, meta["lora_base"]["path"])))
    tensors = with_untrained(model.hf_tensors(merged=merged), meta["hf_config"], like)
    return str(save_hf(out_dir, tensors, meta["hf_config"], extra_files_from=like))


def mcore2hf(mcore_dir: str, out_dir: str, like: str | None = None, merged: bool = False) -> Path:
    """A complete HF directory from any Megatron directory orz wrote; `like` (an HF dir) supplies
    the tokenizer and other files (default: those kept for it: hf2mcore's beside it, a trainer
    checkpoint's in its run directory). Refused, before anything is written, where there are none.
    A LoRA actor's checkpoint gives its adapter as a PEFT directory, or with `merged` the merged model;
    its base must still be where it was trained, with the same weights (by their fingerprint)."""
    meta = read_megatron_meta(mcore_dir)  # refuses any other format, naming it, before a process starts
    if merged and "lora" not in meta:
        raise ModelConfigError(f"{mcore_dir}: --merged merges a LoRA checkpoint's adapters, and this one has none")
    base = meta.get("lora_base")
    if base and (not Path(base["path"]).is_dir() or weights_fingerprint(base["path"]) != base["fingerprint"]):
        raise ModelConfigError(f"{mcore_dir}: its adapters were trained on {base['path']}, which is gone or holds "
                               "other weights now; put that base model back there")
    like = like or kept_hf_files(mcore_dir)
    if meta["value_head"]:
        raise ModelConfigError(f"{mcore_dir}: a value model's checkpoint (critic): its scalar head has no HF "
                               "causal-LM form; export the actor's")
    if like is None:  # before anything is written: a directory without a tokenizer fails later, elsewhere
        raise ModelConfigError(f"{mcore_dir}: no tokenizer files kept for this checkpoint (a trainer checkpoint "
                               "written before 2026-12-07 references none); pass --like <the HF directory it was "
                               "trained from>, whose tokenizer, generation config and chat template are copied")
    require_untrained_source(meta["hf_config"], like, str(mcore_dir))
    return Path(run_world(_mcore2hf_rank, 1, str(mcore_dir), str(out_dir), like, merged, timeout=3600)[0])


def _upgrade_rank(rank, world, spec, old_dir, new_dir):
    """Built from the role's spec at its saved layout, as its workers built it; read in the earlier
    format, written in Megatron's with what a worker's save records (the scheduler's steps)."""
    from orz.models import dist_checkpoint, legacy_checkpoint
    from orz.models.megatron_model import MegatronModel
    from orz.models.parallel import init_model_parallel

    init_model_parallel(spec.model.sizes, seed=spec.seed)
    ckpt = HFCheckpoint(spec.model_path)
    model = MegatronModel(ckpt.arch, spec.model)
    model.load_hf(ckpt)
    steps = legacy_checkpoint.load(model, old_dir)
    dist_checkpoint.save(model, new_dir, {"role": spec.name} | ({"scheduler_steps": steps} if spec.train else {}),
                         ckpt.config)


def upgrade(iteration_dir: str) -> list[Path]:
    """Every role of a checkpoint written before 2026-12-05 re-saved in Megatron's format, in place,
    once: read in a local world at its saved layout, built as its run's config (trainer_state.json
    beside it) says. Returns the role directories it converted."""
    from orz.models import legacy_checkpoint
    from orz.run.role_spec import role_spec

    iteration_dir = Path(iteration_dir)
    state_file = iteration_dir / "trainer_state.json"
    if not state_file.is_file():
        raise ModelConfigError(f"{state_file}: missing; `orz convert upgrade` takes a run's checkpoint directory, "
                               "<run>/checkpoints/iter_N, whose trainer_state.json holds the run's config")
    cfg = from_dict(ExperimentConfig, json.loads(state_file.read_text())["config"])
    done = []
    for name in ROLES_WITH_CHECKPOINTS:
        role_dir = iteration_dir / name
        if not is_earlier_format(role_dir):
            continue
        spec = role_spec(cfg, name, sizes=Sizes(**legacy_checkpoint.saved_layout(role_dir)))
        with atomic_dir(role_dir) as tmp:
            run_world(_upgrade_rank, spec.model.sizes.workers, spec, str(role_dir), str(tmp), timeout=3600)
        done.append(role_dir)
    if done and not (iteration_dir / "pending_batches.pt").is_file():  # the earliest kept no batches ahead
        torch.save([], iteration_dir / "pending_batches.pt")
    if not done:
        raise ModelConfigError(f"{iteration_dir}: holds no role in the format orz wrote before 2026-12-05 "
                               f"(looked for {', '.join(ROLES_WITH_CHECKPOINTS)})")
    return done


def _verify_rank(rank, world, hf_dir, tp, pp, ep, etp, tokens):
    from orz.models.megatron_model import MegatronModel
    from orz.models.parallel import init_model_parallel

    sizes = Sizes(tp=tp, pp=pp, ep=ep, etp=etp)
    init_model_parallel(sizes)
    ckpt = HFCheckpoint(hf_dir)
    model = MegatronModel(ckpt.arch, ModelSpec(sizes=sizes))
    model.load_hf(ckpt)
    return model.full_logits(tokens)


def verify(hf_dir: str, tp: int, pp: int, batch: int = 2, seq: int = 32, seed: int = 0, ep: int = 1,
           etp: int = 1) -> dict:
    from transformers import AutoModelForCausalLM

    ckpt = HFCheckpoint(hf_dir)
    ckpt.arch.check_parallel(tp, pp, ep, etp)
    dp = smallest_dp(tp, ep, etp)
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
    p = sub.add_parser("hf2mcore", help="HF directory -> Megatron's format (weights only)")
    p.add_argument("--hf", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--tp", type=int, default=1, help="TP of the local processes that load it (pads the vocabulary)")
    p.add_argument("--pp", type=int, default=1, help="PP of the local processes that load it")
    p.add_argument("--vocab-divisible-by", type=int, default=1, help="pad vocab to a multiple of this × TP")
    _expert_args(p)
    p = sub.add_parser("mcore2hf", help="Megatron's format (a trainer checkpoint's role too) -> HF directory")
    p.add_argument("--mcore", required=True, help="hf2mcore's output, or <run>/checkpoints/iter_N/actor")
    p.add_argument("--out", required=True)
    p.add_argument("--like", help="HF directory to copy tokenizer files from")
    p.add_argument("--merged", action="store_true", help="a LoRA checkpoint: the merged model, not the adapter")
    p = sub.add_parser("upgrade", help="a checkpoint orz wrote before 2026-12-05 -> Megatron's format, in place")
    p.add_argument("checkpoint", help="<run>/checkpoints/iter_N")
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
            print(mcore2hf(args.mcore, args.out, args.like, args.merged))
        elif args.command == "upgrade":
            print("\n".join(map(str, upgrade(args.checkpoint))))
        else:
            print(json.dumps(verify(args.hf, args.tp, args.pp, ep=args.ep, etp=args.etp)))
    except (ModelConfigError, ConfigError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
