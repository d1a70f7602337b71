"""The processes of a merge together.

    comm.py    the process group (gloo on CPU, NCCL on GPU), collectives, and one error raised on every rank
    watchdog/  a rank that stops answering is named, and every live rank exits within --timeout
"""
