"""What several test modules share, apart from pytest's fixtures (tests/conftest.py): the quantization formats
written out from their specifications (fp8_recipe.py, fp4_recipe.py), never read from distmerge's own code, so
that an expected value never comes from the code under test. No test module imports another test module."""
