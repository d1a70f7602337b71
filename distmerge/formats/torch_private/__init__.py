"""The only package that touches private PyTorch details, so that a torch upgrade is a change here only:

- state_dicts.py: torch.save zip records, DTensor specs, FSDP1's ShardedTensor pickle (per-rank files)
- dcp/: torch.distributed.checkpoint's `.metadata` pickle and the torch.save blobs inside `.distcp`
- restricted.py, torch_save.py: torch.save files read without torch.load (Megatron legacy, DeepSpeed)
- zip_records.py, pickle_scan.py: every archive and pickle checked against budgets before it is unpickled

Nothing here runs code from a checkpoint: pickles are read with torch's weights_only loader or with a
restricted unpickler whose allow-list maps every global to an inert stand-in, and only after pickle_scan
has checked the opcode stream (globals by name, memo, nesting, tree size, keys, storages and views).
"""
