"""MoE routing replay (R3) through Megatron's RouterReplay: the trainer's routers use the experts
recorded at sampling time instead of choosing, and still say what they would have chosen.

    routes = MoeRoutes(module, arch)      # after building the model
    routes.replay(recorded)               # (B, S, L, K) expert ids per token and MoE layer; -1: padding
    output = module(...)                  # every MoE layer of this stage routes as recorded
    own = routes.chosen((B, S), B, S)     # (B, S, L, K): what this stage's routers would have chosen

L counts the model's MoE layers in order (arch.moe.layers); a pipeline stage replays and reports
its own, the other columns of `chosen` are -1. Tokens are (B, S) here and (S·B,) in the router.
"""
import torch
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

from orz.models.arch import ModelArch


class _ReplayKeepingOwnChoice(RouterReplay):
    """Megatron's RouterReplay whose replayed forward also records the router's own top-k, and
    routes the tokens that have no recorded route (-1: padding, the engine's last token) as the
    router chooses: the experts then see the same tokens as in a free forward at the same weights,
    so replaying a free forward's routes reproduces it bit for bit, whatever the GEMM's rounding
    makes of a batch's size (AVX2 MKL rounds a row differently at other row counts)."""

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        if self.router_replay_action != RouterReplayAction.REPLAY_FORWARD:
            return super().get_replay_topk(scores, topk, num_groups, group_topk, default_compute_topk)
        own = default_compute_topk(scores, topk, num_groups, group_topk)[1]
        self.record_indices(own)
        target = self.target_topk_idx.to(scores.device)
        indices = torch.where((target < 0).any(-1, keepdim=True), own, target)
        return scores.gather(1, indices), indices


class MoeRoutes:
    """Replay and record of one model's routes. Addresses its own routers, never Megatron's global
    list, so that two models in one process stay apart."""

    def __init__(self, module: torch.nn.Module, arch: ModelArch):
        self.top_k = arch.moe.top_k
        self.num_layers = len(arch.moe.layers)
        column = {layer: i for i, layer in enumerate(arch.moe.layers)}
        self.routers: list[tuple[int, RouterReplay]] = []  # (column in L, this stage's router)
        for router in (m for m in module.modules() if isinstance(m, TopKRouter)):
            router.router_replay = _ReplayKeepingOwnChoice()
            RouterReplay.global_router_replay_instances.remove(router.router_replay)
            self.routers.append((column[router.layer_number - 1], router.router_replay))  # layer_number: 1-based
        self.record()

    def record(self) -> None:
        """The routers choose (and record their choice)."""
        for _, replay in self.routers:
            replay.clear_indices()
            replay.set_router_replay_action(RouterReplayAction.RECORD)

    def replay(self, routes: torch.Tensor) -> None:
        """The next forward routes token (b, s) in MoE layer l to routes[b, s, l]; a token without
        a route (-1) goes where the router chooses (no real token reads its output: causal attention)."""
        b, s, layers, k = routes.shape
        if (layers, k) != (self.num_layers, self.top_k):
            raise ValueError(f"routes (B, S, L, K) = {tuple(routes.shape)}; the model has L = {self.num_layers} "
                             f"MoE layers and K = {self.top_k}")
        routes = routes.long()
        for column, replay in self.routers:
            replay.clear_indices()
            replay.set_target_indices(routes[:, :, column].transpose(0, 1).reshape(s * b, k))  # (S·B, K)
            replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

    def chosen(self, padded: tuple[int, int], b: int, s: int) -> torch.Tensor:
        """(b, s, L, K) the experts this stage's routers chose (or would have, under replay) in the
        last forward, whose input was `padded` = (B', S'), cut to its first b rows and s columns;
        -1 in other stages' layers."""
        out = torch.full((b, s, self.num_layers, self.top_k), -1, dtype=torch.long)
        for column, replay in self.routers:
            own = replay.get_recorded_indices().reshape(padded[1], padded[0], self.top_k)  # (S', B', K)
            out[:, :, column] = own.transpose(0, 1)[:b, :s]
        return out
