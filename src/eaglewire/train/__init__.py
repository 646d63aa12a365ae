"""Training: the target's own answers (regenerate), initialization, training-time test, the training loop."""
