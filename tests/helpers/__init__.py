"""What several test modules share besides the fixtures of tests/conftest.py, so that no test module imports
another: each module here says which tests use it. Two of them write formats out from their specifications, never
from distmerge's own code, so that an expected value never comes from the code under test:

    fp8_recipe.py   FP8 per 128 x 128 block and per channel: the expected bytes, their dequantization and bound
    fp4_recipe.py   NVFP4 and MXFP4: e2m1 rounding and packing, group and global scales, the fused sets
"""
