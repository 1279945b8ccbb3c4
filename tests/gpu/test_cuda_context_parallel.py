"""`<role>.cp` on GPU: the same log-probs and the same gradient at CP 2 as at CP 1.

Needs two GPUs and Transformer Engine (its attention runs the CP ring); the lent machine has one
GPU and no TE, so this is skipped there too: context parallelism is untested so far.
"""
import importlib.util

import pytest
import torch

from orz.models.local_world import run_world

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2 or importlib.util.find_spec("transformer_engine") is None,
                                reason="needs 2 GPUs and Transformer Engine")


def _logprobs_and_grad_norm(rank, world, path, tokens, cp):
    from orz.models.checkpoint import HFCheckpoint
    from orz.models.inputs import ModelInputs
    from orz.models.megatron_model import MegatronModel
    from orz.models.parallel import init_model_parallel
    from orz.models.spec import ModelSpec, OptimSpec, Sizes

    init_model_parallel(Sizes(cp=cp))
    ckpt = HFCheckpoint(path)
    engine = MegatronModel(ckpt.arch, ModelSpec(sizes=Sizes(cp=cp), optim=OptimSpec(lr=1e-5), dtype="bfloat16"))
    engine.load_hf(ckpt)
    ids = tokens.cuda()
    engine.model.eval()
    with torch.no_grad():
        [logprobs] = engine.run([ModelInputs(ids)], collect=lambda hidden, mb: engine.next_token_logprobs(hidden, ids))
    out = engine.train_step([ModelInputs(ids)], lambda hidden, mb: (-engine.next_token_logprobs(hidden, ids).mean(), {}))
    return logprobs.float().cpu(), out["grad_norm"]


def test_cp2_gives_cp1s_logprobs_and_gradient(tmp_path):
    from orz.models.tiny import make_tiny_hf

    path = make_tiny_hf(tmp_path / "llama", vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=2,
                        num_heads=8, num_kv_heads=2)
    tokens = torch.randint(0, 512, (2, 250))  # padded to 252 = a multiple of 2·cp
    [(one, norm_one)] = run_world(_logprobs_and_grad_norm, 1, path, tokens, 1)
    for logprobs, norm in run_world(_logprobs_and_grad_norm, 2, path, tokens, 2):
        assert (logprobs - one).abs().max() <= 0.05  # bf16, attention split differently
        assert abs(norm - norm_one) <= 0.02 * norm_one
