"""The engine: the target's lean forward, the drafter at serving time, drafting, verification, sampling."""
