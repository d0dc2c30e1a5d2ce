"""Planning before renting: the whole run's bill per node kind and count (stage, bill), the GPU
stages' hours from arithmetic (train_cost), and the pilot that measures them on a sample first
(pilot, and burst: its short training run)."""
