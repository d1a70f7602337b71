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
FINALIZE_TAIL = """\
    write_config(out, {**config, **plan.config_updates, **later}, announced_dtype(plan))
    remove_strays(out, plan)
    write_extra_files(out, plan)
    write_manifest(out, plan)
    write_index(out, plan)  # last: its presence means every file above is complete
"""
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
    Mutation(name="43-4b-watch-once-interrupt-exit-0-cli", guarantee="one-line errors / exit status",
             why="the command ends an interrupted `watch --once` with status 0",
             file="distmerge/front/cli.py",
             old="        return 130\n    if _rank() == 0 and not args.quiet:\n",
             new="        return 0\n    if _rank() == 0 and not args.quiet:\n",
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
    Mutation(name="43-8-borrowed-group-held-by-defaults", guarantee="the API leaves the job as it was",
             why="the API's close leaves torch.distributed.nn.functional's defaults holding the job's group (imported "
                 "by the call with the group up): the group outlives destroy_process_group, the job aborts at exit",
             file="distmerge/distributed/comm.py",
             old="            held_defaults.give_back(dist.group.WORLD, self._modules_at_borrow)\n",
             new="            pass\n",
             tests=("tests/test_import_api.py::test_a_running_job_imports_with_the_api_on_every_rank",)),
)

PROMISES = (
    Mutation(name="exactness-dtensor-chunk-floor", guarantee="exactness",
             why="a DTensor shard's offsets computed with floor division, not torch.chunk's ceiling",
             file="distmerge/formats/torch_private/state_dicts.py",
             old="chunk = math.ceil(shape[dim] / parts) if shape[dim] else 0",
             new="chunk = shape[dim] // parts if shape[dim] else 0",
             tests=("tests/test_merge_fsdp.py::test_merged_equals_reference",)),
    Mutation(name="read-once-fragment-read-twice", guarantee="read once",
             why="each fragment read a second time (a checksum pass over the input)",
             file="distmerge/engine/reader.py",
             old="        self._read_into(frag, dest, count)\n",
             new="        self._read_into(frag, dest, count)\n        self._read_into(frag, dest, False)\n",
             tests=("tests/test_promises.py::test_each_input_byte_is_read_once",)),
    Mutation(name="atomic-output-index-first", guarantee="atomic output",
             why="the index written before config.json and the manifest: an index on disk before the model is whole",
             file="distmerge/engine/finalize.py",
             old=FINALIZE_TAIL, new="    write_index(out, plan)\n" + FINALIZE_TAIL.rsplit("    write_index", 1)[0],
             tests=("tests/test_promises.py::test_the_index_is_written_last",)),
    Mutation(name="lock-folder-lock-overwritten", guarantee="lock",
             why="the folder lock made by rename (which replaces a holder's lock) instead of link (which fails)",
             file="distmerge/output/local_lock.py",
             old="os.link(temp, self.path)", new="os.replace(temp, self.path)",
             tests=(f"{LOCK}::test_a_requeued_merge_fails_at_once_and_the_first_keeps_its_model",)),
    Mutation(name="resume-keeps-another-runs-file", guarantee="resume",
             why="a finished file is kept without checking that its record is of this run's fingerprint",
             file="distmerge/engine/resume.py",
             old='if record is None or record.get("fingerprint") != fp:', new="if record is None:",
             tests=("tests/test_resume.py::test_resume_redoes_everything_when_the_input_changed",)),
    Mutation(name="one-line-errors-traceback", guarantee="one-line errors",
             why="a user error printed with its traceback, as with --debug",
             file="distmerge/front/cli.py",
             old="    if debug:\n        import traceback\n", new="    if True:\n        import traceback\n",
             tests=(f"{LOCK}::test_a_requeued_merge_fails_at_once_and_the_first_keeps_its_model",
                    "tests/test_bad_inputs.py::test_bad_input")),
    Mutation(name="quantize-fp8-scale-off", guarantee="quantization layouts",
             why="the FP8 scale divides the amax by 447 rather than e4m3's largest value, 448",
             file="distmerge/quantize/fp8.py",
             old="    scale = amax / FP8_MAX\n", new="    scale = amax / (FP8_MAX - 1)\n",
             tests=("tests/test_quantize.py::test_the_quantization_is_the_recipe",)),
    Mutation(name="quantize-fp4-nibbles-swapped", guarantee="quantization layouts",
             why="the packed e2m1 pairs with the even column in the high nibble",
             file="distmerge/quantize/fp4.py",
             old="return pairs[..., 0].bitwise_or(pairs[..., 1].bitwise_left_shift(4))",
             new="return pairs[..., 1].bitwise_or(pairs[..., 0].bitwise_left_shift(4))",
             tests=("tests/test_quantize_fp4.py::test_fused_sets_share_one_global_scale_without_the_peer",)),
    Mutation(name="average-float32-sum", guarantee="averaging formula",
             why="the average summed in float32, not float64",
             file="distmerge/average/fold.py",
             old="state = [torch.empty(t.shape, dtype=torch.float64, device=t.device) if f else None",
             new="state = [torch.empty(t.shape, dtype=torch.float32, device=t.device) if f else None",
             tests=("tests/test_average.py::test_the_average_of_three_formats_and_world_sizes_is_the_formula",
                    "tests/test_average.py::test_bf16_inputs_are_summed_in_float64_and_cast_once")),
    Mutation(name="average-weights-reversed", guarantee="averaging formula",
             why="each input weighted with another input's weight (the list read from its end)",
             file="distmerge/average/fold.py",
             old="add_weighted(state[j], tensor, weights[k], names[j], first=first)",
             new="add_weighted(state[j], tensor, weights[-1 - k], names[j], first=first)",
             tests=("tests/test_average.py::test_bf16_inputs_are_summed_in_float64_and_cast_once",)),
)

EARLIER_AUDIT = (
    Mutation(name="audit-api-random-state-not-restored", guarantee="the API leaves the caller's process as it was",
             why="the caller's Python random state not restored after an API call",
             file="distmerge/api.py",
             old="        random.setstate(state)\n", new="        pass\n",
             tests=("tests/test_api.py::test_a_call_leaves_the_callers_random_stream_as_it_found_it",)),
    Mutation(name="audit-shard-ndim-accepted", guarantee="untrusted input",
             why="Shard(ndim) accepted (a dimension past the tensor's last, read as Shard(0))",
             file="distmerge/formats/torch_private/state_dicts.py",
             old="not -ndim <= dim < ndim", new="not -ndim <= dim <= ndim",
             tests=("tests/test_hostile_structures.py::test_placement_of_refuses_the_dims_a_tensor_lacks",)),
    Mutation(name="audit-routed-experts-not-quantized", guarantee="quantization layouts",
             why="routed experts left out of --quantize",
             file="distmerge/quantize/table.py",
             old='    r"mlp\\.experts\\.\\d+\\.(?:gate|up|down)_proj",  # Qwen MoE, DeepSeek-V3 routed experts\n',
             new="",
             tests=("tests/test_quantize.py::test_the_moe_families_write_their_experts_in_fp8",)),
    Mutation(name="audit-last-multipart-part-dropped", guarantee="exactness (object store)",
             why="the last part of each run of an object's multipart upload left out",
             file="distmerge/output/s3.py",
             old="out.extend((first + k, cuts[k], cuts[k + 1], writer) for k in range(count))",
             new="out.extend((first + k, cuts[k], cuts[k + 1], writer) for k in range(max(1, count - 1)))",
             tests=("tests/test_s3.py::test_parts_are_numbered_in_file_order_and_large_enough",)),
)

MULTINODE = "tests/test_multinode.py"
NODES = (
    Mutation(name="nodes-read-off-node", guarantee="files where the nodes left them",
             why="a file is given to any rank, not to one of a node that holds it",
             file="distmerge/engine/placement.py", old="allowed = placement.may_read[f.index] or range(world)",
             new="allowed = range(world)",
             tests=(f"{MULTINODE}::test_fsdp2_rank_files_on_two_nodes_markers_on_the_other",)),
    Mutation(name="nodes-remote-read-offset", guarantee="files where the nodes left them",
             why="a node answers rank 0's read of its file from the file's start, whatever the offset asked",
             file="distmerge/input/nodes.py", old="return self._open[key].pread(min(nbytes, FETCH_PIECE), offset)",
             new="return self._open[key].pread(min(nbytes, FETCH_PIECE), 0)",
             tests=(f"{MULTINODE}::test_fsdp2_rank_files_on_two_nodes_markers_on_the_other",)),
    Mutation(name="nodes-output-probe-skipped", guarantee="files where the nodes left them",
             why="every node is taken to see the output: a node-local output is written on one node only",
             file="distmerge/engine/nodes.py", old="store.read(NODES_PROBE) == token if first else True", new="True",
             tests=(f"{MULTINODE}::test_an_output_some_nodes_cannot_see_is_refused",)),
    Mutation(name="nodes-owner-far-from-reads", guarantee="files where the nodes left them",
             why="each output file's owner is chosen by load alone: bytes cross nodes that need not",
             file="distmerge/engine/placement.py",
             old="near = {n for n, b in reads.items() if b >= NEAR * most} if most else allowed",
             new="near = allowed",
             tests=(f"{MULTINODE}::test_megatron_torch_dist_on_two_nodes_config_on_the_other",)),
    Mutation(name="nodes-verify-compared-off-node", guarantee="files where the nodes left them",
             why="verify gives a finished model's file to any rank, not to one of a node that holds it",
             file="distmerge/verifier/compare.py",
             old="ranks = [r for r in range(world) if nodes.of_rank[r] in holding]",
             new="ranks = list(range(world)) if holding else []",
             tests=(f"{MULTINODE}::test_verify_of_finished_models_on_node_local_disks",)),
    Mutation(name="nodes-verify-owner-off-reference", guarantee="files where the nodes left them",
             why="verify of a checkpoint assembles targets on ranks whose node lacks the reference",
             file="distmerge/verifier/checkpoint.py",
             old="placement=nodes.placement_of(comm, found.scan, may_own=where)",
             new="placement=nodes.placement_of(comm, found.scan)",
             tests=(f"{MULTINODE}::test_verify_of_a_checkpoint_against_a_reference_on_one_node",)),
    Mutation(name="nodes-copy-checked-by-machine", guarantee="files where the nodes left them",
             why="a file's device and inode are checked on every node of the machine that listed it, so another "
                 "node's copy of the folder is refused as changed",
             file="distmerge/input/local.py", old="(dev, ino) if walked.host == node_key() else None",
             new="(dev, ino) if walked.host.startswith(tree.host_id()) else None",
             tests=(f"{MULTINODE}::test_a_copy_of_the_checkpoint_on_each_node",)),
)

MUTATIONS: tuple[Mutation, ...] = ISSUE_43 + PROMISES + EARLIER_AUDIT + NODES

# The --quantize registry (#44): a scheme is one object, the command line offers what is registered, each folder runs
# in a plain from_pretrained
SCHEMES_FILE = "tests/test_quantize_schemes.py"
SCHEMES = (
    Mutation(name="44-1-scheme-config-falls-back-to-fp8", guarantee="quantization layouts",
             why="a scheme the config code does not name gets fp8-channel's quantization_config, silently",
             file="distmerge/quantize/schemes.py",
             old="        return scheme(self.scheme).config(list(self.unconverted))",
             new="        row = scheme(self.scheme)\n"
                 "        known = row.name in ('fp8-block', 'nvfp4', 'mxfp4')\n"
                 "        return (row if known else fp8.FP8_CHANNEL).config(list(self.unconverted))",
             tests=(f"{SCHEMES_FILE}::test_a_registered_scheme_gets_its_own_config",)),
    Mutation(name="44-2-quantize-choices-written-out", guarantee="quantization layouts",
             why="--quantize's choices written out by hand, one scheme left out",
             file="distmerge/output_options.py", old='registry=_schemes, metavar="SCHEME"',
             new='choices=("fp8-block", "fp8-channel", "nvfp4"), metavar="SCHEME"',
             tests=(f"{SCHEMES_FILE}::test_the_command_line_offers_every_registered_scheme",)),
    Mutation(name="44-3-4-bit-config-names-the-merge-dtype", guarantee="quantization layouts",
             why="a float32 or float16 merge's 4-bit folder names its dtype: transformers decompresses into bfloat16 "
                 "and the first matmul fails",
             file="distmerge/quantize/fp4.py", old="        return self.DECODED", new="        return dtype",
             tests=(f"{SCHEMES_FILE}::test_each_folder_runs_in_a_plain_from_pretrained",)),
    Mutation(name="44-4-encoded-from-config-dtype", guarantee="quantization layouts",
             why="verify takes the dtype a folder's weights were quantized from out of its config.json, which names "
                 "the dtype they load in",
             file="distmerge/verifier/listing.py", old="model_dtype=_main_dtype(merged))",
             new="model_dtype={'bfloat16': 'BF16', 'float32': 'F32'}.get((config or {}).get('dtype')))",
             tests=("tests/test_quantize_fp4_verify.py::"
                    "test_in_memory_and_against_the_checkpoint_give_the_folder_records",)),
)
MUTATIONS = MUTATIONS + SCHEMES

# issue #45, `distmerge import --to megatron`: TP x PP together, MoE experts over EP (tests/test_import_megatron*.py)
IMPORT_FILE, IMPORT_MOE_FILE = "tests/test_import_megatron.py", "tests/test_import_megatron_moe.py"
IMPORT_CKPT_FILE = "tests/test_import_checkpoint.py"
DIST_LAYOUT = "distmerge/formats/megatron/dist_layout.py"
IMPORT_LAYOUTS = (
    Mutation(name="45-1-experts-round-robin-over-ep", guarantee="Megatron import layout",
             why="expert e written in the files of EP rank e % EP, not megatron-core's contiguous block of E/EP",
             file=DIST_LAYOUT, old="return 0 if expert is None else expert[1] // (self.experts // self.ep)",
             new="return 0 if expert is None else expert[1] % self.ep",
             tests=(f"{IMPORT_MOE_FILE}::test_megatron_core_loads_it_at_the_written_layout",)),
    Mutation(name="45-2-expert-offset-local", guarantee="Megatron import layout",
             why="an expert's chunk placed at its local number on the expert axis: EP ranks overwrite each other",
             file=DIST_LAYOUT, old="(grid.layers, grid.experts, *shape), (int(m[2]), expert[1])",
             new="(grid.layers, grid.experts, *shape), (int(m[2]), expert[1] % (grid.experts // grid.ep))",
             tests=(f"{IMPORT_MOE_FILE}::test_megatron_core_loads_it_at_the_written_layout",
                    f"{IMPORT_MOE_FILE}::test_merged_back_it_is_the_source")),
    Mutation(name="45-3-ep-not-checked", guarantee="one-line errors / exit status",
             why="an --ep that does not divide the experts is not refused: a folder no job can load, or a traceback",
             file=DIST_LAYOUT, old="    if grid.experts % grid.ep:", new="    if False:",
             tests=(f"{IMPORT_MOE_FILE}::test_an_ep_the_model_cannot_have_is_refused",)),
    Mutation(name="45-4-pp-major-rank-order", guarantee="Megatron import layout",
             why="a chunk's training rank counted pipeline-major: at TP=2 x PP=2 the files hold other ranks' chunks",
             file=DIST_LAYOUT, old="        return tp + self.tp * ep + self.tp * self.ep * stage",
             new="        return stage + self.pp * (tp + self.tp * ep)",
             tests=(f"{IMPORT_FILE}::test_megatron_core_loads_it_at_the_written_layout",)),
    Mutation(name="45-5-metadata-strings-not-interned", guarantee="N processes write the same bytes",
             why="`.metadata` pickled with strings as each process made them: N=2 refers back where N=1 repeats",
             file="distmerge/formats/torch_private/dcp/write.py",
             old="        e = replace(e, key=sys.intern(e.key), file=sys.intern(e.file))\n", new="",
             tests=(f"{IMPORT_FILE}::test_metadata_bytes_depend_only_on_the_entries",
                    f"{IMPORT_MOE_FILE}::test_two_processes_write_what_one_writes")),
    Mutation(name="45-6-column-split-read-per-chunk", guarantee="each input byte read once",
             why="each TP chunk of a column split reads the tensor's rows at full width: read TP times",
             file="distmerge/importer/read.py",
             old=("        block = rows_of(made, span, rows)\n        for chunk in cut:\n"
                  "            yield chunk, _columns(chunk, block)"),
             new="        for chunk in cut:\n            yield chunk, _columns(chunk, rows_of(made, span, rows))",
             tests=(f"{IMPORT_CKPT_FILE}::test_column_split_tensors_are_read_once",)),
    Mutation(name="45-7-checkpoint-input-not-detected", guarantee="Megatron import layout",
             why="a checkpoint input is taken for a Hugging Face folder and refused for having no config.json",
             file="distmerge/importer/source.py", old="    return registry.detect(src) is not None",
             new="    return False",
             tests=(f"{IMPORT_MOE_FILE}::test_a_legacy_save_imported_merges_back_to_its_source",)),
    Mutation(name="45-8-checkpoint-refused-after-reading-it", guarantee="one-line errors / exit status",
             why="an output in use or an EP config.json forbids is refused only after the checkpoint is read",
             file="distmerge/importer/source.py", old="        self.refuse_early()\n", new="",
             tests=(f"{IMPORT_MOE_FILE}::test_a_legacy_save_at_a_layout_it_cannot_have_is_refused_before_it_is_read",
                    f"{IMPORT_MOE_FILE}::test_a_legacy_save_into_a_folder_in_use_is_refused_before_it_is_read")),
    Mutation(name="45-9-checkpoint-units-not-joined", guarantee="Megatron import layout",
             why="an FSDP save's q, k and v stay three units: a layer's linear_qkv is cut before all its rows are in",
             file="distmerge/importer/source.py",
             old="            groups.join(unit_of[made.sources[0]], unit_of[source])", new="            pass",
             tests=(f"{IMPORT_CKPT_FILE}::test_a_checkpoint_is_written_as_the_import_of_its_merge",)),
    Mutation(name="45-10-object-blobs-overlap", guarantee="Megatron import layout",
             why="the objects' blobs are placed at one offset: the first chunk written over them, .metadata wrong",
             file="distmerge/importer/place.py", old="        at += size\n", new="",
             tests=(f"{IMPORT_FILE}::test_megatron_core_loads_it_at_the_written_layout",)),
)
MUTATIONS = MUTATIONS + IMPORT_LAYOUTS

# issue #45, DeepSeek-V3 to Megatron: multi-latent attention, dense then MoE layers, MTP
# (tests/test_import_megatron_mla.py)
IMPORT_MLA_FILE = "tests/test_import_megatron_mla.py"
IMPORT_MLA = (
    Mutation(name="45-16-mla-rope-pairs-swapped", guarantee="Megatron import layout",
             why="a rope_interleave=false model's rope halves put in pairs (y, x), not (x, y): loads, other logits",
             file="distmerge/families/megatron/transforms.py",
             old="out += [Segment(source=0, start=rope_at + i, count=1), Segment(source=0, start=rope_at + half + i, "
                 "count=1)]",
             new="out += [Segment(source=0, start=rope_at + half + i, count=1), Segment(source=0, start=rope_at + i, "
                 "count=1)]",
             tests=(f"{IMPORT_MLA_FILE}::test_megatron_core_loads_it_without_parallelism",
                    f"{IMPORT_MLA_FILE}::test_merged_back_it_is_the_source")),
    Mutation(name="45-17-dense-moe-boundary-off-by-one", guarantee="Megatron import layout",
             why="moe_layer_freq in the args makes the first MoE layer dense: Megatron-LM builds another model",
             file="distmerge/importer/megatron_args.py",
             old="[0] * sizes.dense_layers + [1] * (sizes.layers - sizes.dense_layers)",
             new="[0] * (sizes.dense_layers + 1) + [1] * (sizes.layers - sizes.dense_layers - 1)",
             tests=(f"{IMPORT_MLA_FILE}::test_megatron_core_loads_it_at_the_written_layout",)),
    Mutation(name="45-18-expert-bias-not-written", guarantee="Megatron import layout",
             why="the router's expert_bias row skipped: DeepSeek-V3's e_score_correction_bias has no Megatron name",
             file="distmerge/families/megatron/inverse.py", old="    if row.grouped:\n",
             new="    if row.grouped or row.source.endswith('.router.expert_bias'):\n",
             tests=(f"{IMPORT_MLA_FILE}::test_megatron_core_loads_it_at_the_written_layout",)),
    Mutation(name="45-19-alone-expert-extra-state-one-shard", guarantee="Megatron import layout",
             why="the experts' _extra_state in a layer saved alone keyed as one shard, not one per expert",
             file=DIST_LAYOUT, old='return f"{module}._extra_state/shard_{expert[1]}_{grid.experts}"',
             new='return f"{module}._extra_state/shard_0_1"',
             tests=(f"{IMPORT_MLA_FILE}::test_megatron_core_loads_it_at_the_written_layout",)),
)
MUTATIONS = MUTATIONS + IMPORT_MLA

# issue #45, --to torchtitan: any checkpoint input in one pass, Qwen3-MoE (tests/test_import_torchtitan.py,
# tests/test_import_checkpoint.py)
IMPORT_TITAN_FILE = "tests/test_import_torchtitan.py"
IMPORT_TITAN = (
    Mutation(name="45-13-titan-hf-config-not-checked-early", guarantee="one-line errors / exit status",
             why="--to torchtitan judges nothing from --hf-config: a family torchtitan lacks is refused only after "
                 "the checkpoint is read",
             file="distmerge/importer/targets.py", old="    torchtitan_inverse.architecture(config)\n",
             new="    pass\n",
             tests=(f"{IMPORT_TITAN_FILE}::test_a_checkpoint_of_a_family_torchtitan_lacks_is_refused_before_it_is_read",)),
    Mutation(name="45-14-titan-experts-misstacked", guarantee="torchtitan import layout",
             why="every expert after the first stacked from expert 1's tensor: loads, other experts",
             file="distmerge/families/torchtitan/inverse.py",
             old="segments = tuple(tf.Segment(source=e, start=0",
             new="segments = tuple(tf.Segment(source=min(e, 1), start=0",
             tests=(f"{IMPORT_TITAN_FILE}::test_torchtitan_starts_from_it",
                    f"{IMPORT_TITAN_FILE}::test_merged_back_it_is_the_source")),
    Mutation(name="45-15-titan-bias-zeros-by-rank-0", guarantee="N processes write the same bytes",
             why="expert_bias_E (no source) written by rank 0 instead of its file's owner: at N=2 a file lacks it",
             file="distmerge/importer/write.py",
             old="                    if not self.plan.tensors[chunk.tensor].sources:",
             new="                    if not self.plan.tensors[chunk.tensor].sources and self.rank == 0:",
             tests=(f"{IMPORT_TITAN_FILE}::test_two_processes_write_what_one_writes",
                    f"{IMPORT_CKPT_FILE}::test_two_processes_write_what_one_writes")),
)
MUTATIONS = MUTATIONS + IMPORT_TITAN

# issue #45, DeepSeek-V3 to torchtitan: MLA, dense then MoE layers, the router's bias, MTP layers
# (tests/test_import_torchtitan.py)
TITAN_INVERSE = "distmerge/families/torchtitan/inverse.py"
IMPORT_TITAN_DSV3 = (
    Mutation(name="45-20-titan-mtp-layer-not-renumbered", guarantee="torchtitan import layout",
             why="Hugging Face layer num_hidden_layers + j written as mtp_layers.{num_hidden_layers + j}, not "
                 "mtp_layers.j: torchtitan's deepseek_v3 finds no MTP weights",
             file=TITAN_INVERSE, old="        shift = layers if row.mtp else 0", new="        shift = 0",
             tests=(f"{IMPORT_TITAN_FILE}::test_torchtitan_starts_from_it",
                    f"{IMPORT_TITAN_FILE}::test_torchtitans_own_deepseek_v3_save_comes_back_as_torchtitan_held_it")),
    Mutation(name="45-21-titan-deepseek-bias-dropped", guarantee="torchtitan import layout",
             why="DeepSeek-V3 given Qwen3-MoE's MoE rows: e_score_correction_bias has no torchtitan name and "
                 "expert_bias_E would be torchtitan's zeros",
             file="distmerge/families/torchtitan/tables.py",
             old='_moe(M + "mlp.gate.e_score_correction_bias")', new="_moe(None, QWEN3_BIAS_WHY)",
             tests=(f"{IMPORT_TITAN_FILE}::test_torchtitan_starts_from_it",
                    f"{IMPORT_TITAN_FILE}::test_torchtitans_own_deepseek_v3_save_comes_back_as_torchtitan_held_it")),
    Mutation(name="45-22-titan-dense-layers-not-checked", guarantee="one-line errors / exit status",
             why="a DeepSeek-V3 whose dense layers are not the first first_k_dense_replace is written: torchtitan "
                 "builds another model (or a config.json of another model is believed)",
             file=TITAN_INVERSE,
             old="    if dense_main != set(range(first)) or routed != set(range(first, layers)):",
             new="    if False:",
             tests=(f"{IMPORT_TITAN_FILE}::test_a_deepseek_v3_whose_dense_layers_are_not_first_k_dense_replace_is_refused",)),
    Mutation(name="45-23-titan-rotary-halves-copied", guarantee="torchtitan import layout",
             why="a rope_interleave=false DeepSeek-V3's rotary rows copied as they are (torchtitan's own from_hf "
                 "does so): loads into torchtitan, which rotates other pairs of rows",
             file="distmerge/families/torchtitan/family.py",
             old="    if row.rope_rows and not mla.rope_interleaved(config):", new="    if False:",
             tests=(f"{IMPORT_TITAN_FILE}::test_torchtitan_starts_from_it",)),
    Mutation(name="45-24-titan-mtp-filed-with-layer-j", guarantee="N processes write the same bytes",
             why="MTP layer j's tensors put in decoder layer j's file: the folder's files are not the documented ones",
             file="distmerge/importer/torchtitan_plan.py",
             old="    return 1 + int(m[2]) + (layers if m[1] else 0)", new="    return 1 + int(m[2])",
             tests=(f"{IMPORT_TITAN_FILE}::test_two_processes_write_what_one_writes",)),
)
MUTATIONS = MUTATIONS + IMPORT_TITAN_DSV3

# issue #45, s3:// input and output for import (tests/test_import_s3.py)
IMPORT_S3_FILE = "tests/test_import_s3.py"
IMPORT_S3 = (
    Mutation(name="45-30-import-output-a-path", guarantee="exactness (object store)",
             why="--output is parsed as a Path: s3://models/x becomes a local folder s3:/models/x, 'written'",
             file="distmerge/options/import_options.py",
             old='("output", Opt(name="output", flags=("--output", "-o"), commands=IMPORT, kind=Kind.LOCATION,',
             new='("output", Opt(name="output", flags=("--output", "-o"), commands=IMPORT, kind=Kind.PATH,',
             tests=(f"{IMPORT_S3_FILE}::test_a_folder_in_a_bucket_imports_as_on_disk",
                    f"{IMPORT_S3_FILE}::test_a_location_that_cannot_be_used_is_one_line")),
    Mutation(name="45-31-object-store-written-by-makers", guarantee="exactness (object store)",
             why="an object store's files are written by the tensors' makers, as a folder's: the uploads have no "
                 "runs to cut into parts (one writer each)",
             file="distmerge/importer/write.py",
             old="    return store.sharing.within == \"none\" or store.sharing.min_run > 0\n",
             new="    return store.sharing.within == \"none\"\n",
             tests=(f"{IMPORT_S3_FILE}::test_a_folder_in_a_bucket_imports_as_on_disk",
                    f"{IMPORT_S3_FILE}::test_two_processes_write_into_a_bucket_what_one_writes_into_a_folder")),
    Mutation(name="45-32-checkpoint-into-a-bucket-not-refused", guarantee="one-line errors / exit status",
             why="a training checkpoint is imported into an object store, whose parts wait in memory for bytes the "
                 "merge engine hands out in its own order",
             file="distmerge/importer/run.py",
             old="    if owners_alone(store) and not source.chooses_makers:\n",
             new="    if False:\n",
             tests=(f"{IMPORT_S3_FILE}::test_a_checkpoint_in_a_bucket_imports_as_on_disk",)),
    Mutation(name="45-33-failed-import-uploads-left-open", guarantee="atomic output",
             why="a failed import does not abort its uploads: parts stay stored (and billed), never completed",
             file="distmerge/importer/write.py",
             old="    except BaseException:\n        out.abort()\n        raise\n",
             new="    except BaseException:\n        raise\n",
             tests=(f"{IMPORT_S3_FILE}::test_a_failed_upload_leaves_nothing_that_looks_like_an_import",)),
    Mutation(name="45-34-bucket-input-named-by-its-listing-path", guarantee="inputs never modified",
             why="a bucket input is named by the path its listing is looked up by, not its URL: an output inside "
                 "the input's prefix is not refused, and the import writes into the input",
             file="distmerge/importer/discover.py",
             old="    return Model(root=src.shown(str(root)),",
             new="    return Model(root=str(root),",
             tests=(f"{IMPORT_S3_FILE}::test_a_location_that_cannot_be_used_is_one_line",)),
)
MUTATIONS = MUTATIONS + IMPORT_S3

# The import's refusals name the options it has (--overwrite), never merge's --resume (tests/test_import_megatron.py)
IMPORT_REFUSALS = (
    Mutation(name="45-35-import-refusal-offers-resume", guarantee="one-line errors / exit status",
             why="an import into a folder holding files is told to pass --resume, an option import does not have",
             file="distmerge/importer/run.py",
             old="    store.check(model.root, opts.overwrite, resumable=False)\n",
             new="    store.check(model.root, opts.overwrite)\n",
             tests=("tests/test_import_megatron.py::test_an_output_in_use_is_refused_with_what_import_takes",)),
)
MUTATIONS = MUTATIONS + IMPORT_REFUSALS
