"""torch.distributed.checkpoint folders: plain DCP (folder), PyTorch's Hugging Face writer (hf_writer),
the key conventions of the trainers that save DCP (keys).
"""
