"""The realistic bugs run.py plants, one at a time: each a textual patch (file, a snippet that is in it once, what
replaces it), the guarantee it breaks, and the tests that must catch it (pytest arguments, from the repository's
root). One or more per guarantee the README makes, the seven bugs of issue #43 and the four of the audit before."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, kw_only=True)
class Mutation:
    name: str
    guarantee: str
    why: str  # what the bug does, in a sentence
    file: str
    old: str
    new: str
    tests: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)  # what the tests need set (the SLURM tests: asked for)


LOCK = "tests/test_output_lock.py"
WATCH = "tests/test_watch.py"

ISSUE_43 = (
    Mutation(name="43-1-s3-lock-release-unconditional", guarantee="lock",
             why="releasing an S3 lock without If-Match deletes the lock of a merge that took it over",
             file="distmerge/output/s3_lock.py",
             old='self._call("delete_object", IfMatch=etag)', new='self._call("delete_object")',
             tests=(f"{LOCK}::test_a_merge_whose_object_lock_was_taken_over_leaves_the_new_holders_lock",)),
    Mutation(name="43-2-watchdog-first-reading-late", guarantee="silent rank named",
             why="the watchdog's first reading moved to --timeout: the silent rank is named at about twice it",
             file="distmerge/distributed/watchdog/dog.py",
             old="if first is None and waited < self.timeout - self.window:",
             new="if first is None and waited < self.timeout:",
             tests=("tests/test_silent_rank.py::test_a_silent_rank_is_named_at_the_first_look_past_the_timeout",)),
    Mutation(name="43-3-s3-continuation-unpinned", guarantee="exactness (object store)",
             why="a cut S3 body is continued without the first answer's ETag: old and new bytes joined",
             file="distmerge/s3_client.py",
             old='        etag = etag or response.get("ETag")\n', new="",
             tests=("tests/test_faults_s3.py::test_an_object_replaced_between_a_cut_and_its_continuation_is_not_joined",)),
    Mutation(name="43-4-watch-once-interrupt-exit-0", guarantee="one-line errors / exit status",
             why="SIGTERM or Ctrl-C during `watch --once` ends it as a stopped watch: exit 0, not 130",
             file="distmerge/watcher/passes.py",
             old="    except KeyboardInterrupt:\n        if opts.once:\n            raise\n",
             new="    except KeyboardInterrupt:\n",
             tests=(f"{WATCH}::test_sigterm_in_a_once_watch_exits_130_and_the_next_watch_resumes",)),
    Mutation(name="43-5-average-shared-source-dropped", guarantee="averaging formula",
             why="a source several inputs share is dropped after the first input's step (then read as empty memory)",
             file="distmerge/engine/fold.py",
             old="self.last = {i: k for k, group in enumerate(self.groups) for i in group}",
             new="self.last = {i: k for k, group in reversed(list(enumerate(self.groups))) for i in group}",
             tests=("tests/test_lora_only.py::test_two_lora_only_saves_averaged_with_their_shared_base",)),
    Mutation(name="43-6a-nvfp4-global-scale-per-weight", guarantee="quantization layouts",
             why="q/k/v and gate/up no longer share NVFP4's global scale: each weight its own",
             file="distmerge/quantize/table.py",
             old="sets.get(unit.targets[i].name, unit.targets[i].name) if row.fused",
             new="unit.targets[i].name if row.fused",
             tests=("tests/test_quantize_fp4.py::test_fused_sets_share_one_global_scale_without_the_peer",)),
    Mutation(name="43-6b-nvfp4-no-qkv-set", guarantee="quantization layouts",
             why="the q/k/v row left out of the fused sets (the test that grouped with fused.sets_of agreed)",
             file="distmerge/quantize/fused.py",
             old='        (r".*(?:attn|attention)\\.", ("q_proj", "k_proj", "v_proj")),\n', new="",
             tests=("tests/test_quantize_fp4.py::test_fused_sets_share_one_global_scale_without_the_peer",)),
    Mutation(name="43-7-slurm-env-input-and-argument", guarantee="SLURM job script",
             why="merge.sbatch adds --input from DISTMERGE_INPUT even when the arguments give one: two inputs",
             file="slurm/merge.sbatch",
             old='from_environment DISTMERGE_INPUT --input -i "$@"\n',
             new='if [ -n "${DISTMERGE_INPUT:-}" ]; then args+=(--input "$DISTMERGE_INPUT"); fi\n',
             tests=("tests/test_slurm.py::test_arguments_win_over_the_environment",),
             env={"DISTMERGE_SLURM_TESTS": "1"}),
)

MUTATIONS: tuple[Mutation, ...] = ISSUE_43
