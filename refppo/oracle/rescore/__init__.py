"""Re-scoring a dump's sequences with the trainer's own checkpoints, and naming what differs."""
