"""Trainers: elastic PyTorch (``streamrover.trainers.torch``) and their framework-neutral parts (standby workers)."""
