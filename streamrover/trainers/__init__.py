"""Trainers: elastic PyTorch (``torch``), TensorFlow parameter servers (``tensorflow``), and what they share.

The trainer contract (the four rules that keep every record's effect in the model exactly once)
is :mod:`streamrover.trainers.api`; ``standby.py`` holds the framework-neutral warm workers.
"""
