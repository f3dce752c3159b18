"""The training core the distill and heads stages share: examples and batches from the generate
stage's dataset (data.py), the distillation losses and acceptance statistics (losses.py), and
the loop with its processes, precision, checkpoints and resume (loop.py). It imports no stage."""
