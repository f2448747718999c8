"""What Eyrie's train entry (eyrie/stages/train/entry.py) still changes inside speculators 0.9.0, torch and
hs_connectors at run time, each pinned by tests/unit/test_train_patch_guards.py (the hash of the source it replaces or
copies) and counted by benchmarks/train_swaps.py: cpu (the accelerator assumptions EyrieTrainer cannot reach: the step
timer's synchronize, the resume device, gloo under torchrun) and verifier (the target's tensors loaded by their own
names); eyrie/stages/train/online_dataset.py's lock wait is the one other.

The rest changes nothing of speculators: pieces of the drafter's own forward and mask builder, bound on the built
instance by eyrie/stages/train/drafter.py: metrics (accuracy and loss scalars without a GPU sync), one_kv_length (one
key length for every TTT step), startup (the rotary tables eager; Inductor's pointwise setting, through its own
`config.patch`); compile (Inductor's workers started early); switches (train.speed resolved for a launch), feed
(batches copied to the GPU ahead of their step), workers (loader workers without CUDA, from a forkserver),
working_weights (bfloat16 working copies of float32 weights), target_transform (the labels made with the target's own
transform), plateau (the plateau stop's exception), overlay (a module with some attributes replaced, and a library
function's code run against other globals).
"""
