"""Training: the trainer and its parts (checkpoints, distributed set-up, sampler), the torchrun launcher, and the pretrain and sft stage logic."""
