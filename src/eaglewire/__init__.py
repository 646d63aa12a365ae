"""eaglewire: train, verify and serve EAGLE-3 draft models with one explicit hidden-state wiring."""

__version__ = "0.1.0"
