"""A training step around its pipeline: the update cut per slot
(``update``), laid out (``layouts``) and run (``update_run``), and the
state a step keeps between calls and checkpoints: where each leaf is kept
(``keeping``), which process holds each result (``holdings``), a parameter that
stages of several processes read (``sharing``) and orbax's handler for them
(``orbax_arrays``).
"""
