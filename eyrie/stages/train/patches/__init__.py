"""speculators 0.9.0 patched by Eyrie's train entry (eyrie/stages/train/entry.py), one concern a module:

cpu (train without an accelerator), workers (loader workers forked from a server, no CUDA in them), gpu (the GPU
changes, each behind a switch in switches), feed (batches copied to the GPU ahead of their step), build (the drafter
built on its GPU, trained in float32), clip (the gradient clip applied inside fused AdamW), working_weights
(bfloat16 working copies of float32 weights), metrics (accuracy and loss scalars without a GPU sync), saving (the
last whole checkpoint kept), plateau (validation recorded, training stopped at a plateau), verifier (the target's
tensors loaded by their own names), target_transform (the labels made with the target's own transform), compile (the
block mask compiled after the first step), one_kv_length (one key length for every TTT step), startup (the rotary
tables eager, one launch config per pointwise kernel), overlay (a module with some attributes replaced).
"""
