"""How far Adam can move a weight: a bound the bf16 tests hold trained weights to."""


def beyond_adam_steps(weights: dict, initial: dict, steps: int, lr: float) -> list[str]:
    """What moved from `initial` further than `steps` Adam steps can take it, as "name: moved by x".

    Each step moves a weight by about lr (|m̂/√v̂| ≤ 1 at the first step, a little more later): 3·lr
    a step allowed, plus bf16's rounding of the weight, 2⁻⁸ of its size. Optimizer masters taken
    from a random initialisation instead of the loaded weights are off by the weights' own size."""
    beyond = []
    for name, start in initial.items():
        moved = (weights[name].float() - start.float()).abs()
        if not bool((moved <= steps * 3 * lr + start.float().abs() * 2**-8).all()):
            beyond.append(f"{name}: moved by {moved.max():.3g}")
    return beyond
