"""The drafter: the EAGLE-3 model, its native checkpoint, and the drafters shipped in the package."""
