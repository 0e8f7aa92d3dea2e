"""Role logic (trainer, worker, validator) on top of the overlay, store, RL core and proofs."""
