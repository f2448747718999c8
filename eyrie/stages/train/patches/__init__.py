"""What Eyrie's train entry (eyrie/stages/train/entry.py) still changes inside speculators 0.9.0 and torch at run time,
one concern a module, each pinned by tests/unit/test_train_patch_guards.py (the hash of the source it replaces); the
rest is composed (entry.py, loaders.py) or overridden (eyrie_trainer.py: EyrieTrainer):

cpu (the accelerator assumptions EyrieTrainer cannot reach: the step timer's synchronize, the resume device, gloo under
torchrun), gpu (the drafter's GPU changes, each behind a train.speed choice), metrics (accuracy and loss scalars
without a GPU sync), compile (the block mask compiled after the first step), one_kv_length (one key length for every
TTT step), startup (the rotary tables eager, one launch config per pointwise kernel), verifier (the target's tensors
loaded by their own names). Also here, changing nothing of speculators: switches (train.speed resolved for a
launch), feed (batches copied to the GPU ahead of their step), workers (loader workers without CUDA, from a
forkserver), working_weights (bfloat16 working copies of float32 weights), target_transform (the labels made with
the target's own transform), plateau (the plateau stop's exception), overlay (a module with some attributes
replaced).
"""
