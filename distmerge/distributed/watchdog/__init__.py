"""The watchdog: a rank that has waited `--timeout` seconds for another names it, with its host and the phase.

gloo's and NCCL's own timeouts say only that a transfer timed out ("Timed out waiting 20000ms for send operation
to complete"), on the rank that waited, not which rank it waited for. So each process of a group distmerge starts
(comm.Comm under torchrun or srun; not a borrowed group, nothing with one process) runs one daemon thread that

    publishes  every `period` s (timeout/4, at most 5 s), in the job's rendezvous store (the TCPStore of torchrun's
               agent, or of rank 0's process under srun), through a client of its own, under a namespace of the
               Comm's: a Record of this rank (a heartbeat counter, its step: the collectives it has joined, whether
               it waits in one, the phase the engine said, host, pid).
    watches    the main thread's waits (Comm marks each: inside a collective, or for an exchange's all_to_all). Once
               a wait has lasted timeout - window s, it reads every rank's record; once it has lasted the timeout,
               and at least `window` s after that first reading, it reads them again and judges them (judge()):
                 stopped  its heartbeat did not advance: a stopped process, a stalled node
                 stuck    alive, but it has not joined the collective waited for, is not waiting itself (else it
                          is a victim too, of a third), and its step did not advance: a read or write there that
                          does not return (a hung filesystem)
               none: nothing happens; the group's own timeout (timeout + BACKSTOP_S) stays the backstop.
               Only readings of one clock are compared (this host's), never times from other hosts.
               The store itself not answering for `window` s is a verdict too: it names the store's host and, under
               srun, rank 0, whose process serves it.
    ends       on a verdict, when the command asked (`on_silence`, the CLI's): the callbacks of Comm.on_abort run
               (bounded: a hung filesystem must not hold the exit), the lowest live rank prints the line (a store
               key claims it: one line, even when another rank speaks because the lowest never did), every rank
               hands it to on_silence (torchrun's error file), the others wait for the line to be out so that
               torchrun, which stops the job at the first exit, does not kill the speaker first, and the process
               ends with os._exit(1): the main thread is blocked in C, where no exception reaches it. Without
               on_silence (the API) the verdict is kept, and the backstop's error is raised as it (comm.py).

Nothing here touches CUDA (a thread of its own must not, beside NCCL): the store is TCP, the rest is Python. The
main thread does: on a GPU it waits for an exchange by polling its work (pulse.WatchedWork), since NCCL's wait()
returns at once and the CPU would block later, unmarked. The thread is joined by stop() (bounded) before the group
is destroyed: a thread inside a store call at interpreter exit could abort the process (docs/reliability.md, "No
abort at exit"); a request a silent store never answers is left in a daemon thread of its own (dog._stored).

The modules:
    pulse     the main thread's side: Pulse (its step, phase and wait, which Comm keeps) and WatchedWork (an
              exchange's wait, marked); what comm.py imports, with BACKSTOP_S
    verdict   the records, the judgement of two readings (judge) and the line (verdict_line): pure, no I/O
    dog       the thread: publishing, reading the store (bounded: _stored), watching, and the end
"""
