"""Rewards: math answers checked with math-verify in a killable pool, code run in a sandbox."""
