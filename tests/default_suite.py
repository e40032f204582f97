"""Which cases of the long matrices run by default, and which only with ``-m slow``.

The default run (``bash scripts/test.sh``, CI) keeps one case of each capability and must stay
within 15 minutes on a 2-core machine; the cases below repeat a capability that another default
case already covers (a second layout of the same family, a second precision, a CLI or trainer
path that a default case also trains through), so they run with ``-m slow`` (the whole matrix:
``bash scripts/slow_shards.sh``). Each entry names the default case that keeps its capability
in the default run. `tests/conftest.py` marks them; an entry that names no collected test fails
the collection, so a renamed test cannot silently drop out of both runs.
"""

# node id -> the default case that covers its capability
DEMOTED = {
    # Ray Train end to end
    "tests/ray/test_multinode.py::test_collocated_sp2_tp2_dp2_on_two_nodes_is_node_local_and_exact":
        "unit/test_nodes.py (node-local placement) + ray/test_shared_machine (a trainer run)",
    "tests/ray/test_custom_loss_example.py::test_custom_loss_example_trains_checkpoints_and_resumes":
        "distributed/test_open_loop.py::test_custom_loss_matches_the_reference",
    "tests/ray/test_evaluation.py::test_fit_with_validation_keeps_the_best_checkpoint_by_eval_loss":
        "distributed/test_evaluation.py, distributed/test_omni_eval.py",
    "tests/ray/test_cli_tune_job.py::test_cli_train_with_overrides_end_to_end":
        "ray/test_shared_machine.py::test_an_interrupted_cli_run_stops_cleanly_and_resumes[sigterm]",
    "tests/ray/test_trainer.py::test_collocated_sp2_tp2_trains_and_reports":
        "ray/test_shared_machine.py::test_an_interrupted_cli_run_stops_cleanly_and_resumes[sigterm] "
        "(examples/tiny.yaml: collocated SP2 + TP2 through DisaggregatedTrainer)",
    # a neighbour Ray started mid-run: under CI (.ci/run) another Ray's dashboard holds :8265
    # from before the suite starts, so this case's neighbour cannot take :8265 mid-run there (it
    # is the neighbour-first order, which never killed a run); run it with -m slow on a machine
    # without another Ray
    "tests/ray/test_shared_machine.py::test_a_neighbour_cluster_started_mid_run_does_not_kill_it":
        "ray/test_pg_cleaner.py::test_the_cleaner_asks_its_own_gcs (the fix: the cleaner reads "
        "its own GCS, never the state API on :8265)",
    "tests/ray/test_trainer.py::test_bad_lines_are_skipped_and_reported":
        "ray/test_mixture.py (bad lines skipped and reported by fit()) + unit/test_fuzz_bad_data.py",
    "tests/ray/test_fuzz_fit.py::test_fit_skips_exactly_the_hostile_records":
        "unit/test_fuzz_bad_data.py::test_skip_mode_trains_through_every_hostile_record (the same "
        "hostile set and limits, skip mode, through the loader's decoding process) + "
        "ray/test_mixture.py (skipped samples counted once and reported by fit())",
    # the local launcher: the spawn start method keeps its results case (the benchmarks' path)
    "tests/distributed/test_launch.py::test_a_dead_rank_is_named_not_waited_for":
        "test_forkserver_a_dead_rank_is_named_not_waited_for (the same collector) + test_results_come_back_by_rank (spawn)",
    # docs pages whose commands train (README's run by default)
    "tests/docs/test_docs.py::test_page_quick_blocks_run_in_order[docs/quickstart.md]":
        "tests/docs/test_docs.py::test_page_quick_blocks_run_in_order[README.md]",
    # the 30B-A3B example's plan: every example's headroom is planned by default
    "tests/unit/test_moe_config.py::test_30b_a3b_example_fits_on_the_gpus_it_names":
        "tests/unit/test_examples_headroom.py::test_every_gpu_example_keeps_its_headroom (the same "
        "file planned: >= 8% free after the margin, so every rank fits)",
    # planning vs measured memory: the fp32 case stays
    "tests/unit/test_vision_memory.py::test_vision_activation_bytes_match_saved_tensors[qwen2_5_vl-256-bf16]":
        "tests/unit/test_vision_memory.py::...[qwen2_5_vl-512-fp32]",
    # the Omni thinker: its three-module case trains the thinker with images, clips and text-only
    # records (collocated vision SP2 + audio DP2 + text TP2)
    "tests/distributed/test_families.py::test_family_is_exact[qwen2_5_omni-collocated-sp2-tp2]":
        "distributed/test_omni_audio.py::test_omni_three_modules_collocated",
    "tests/distributed/test_omni_eval.py::test_omni_eval_loss_three_modules":
        "distributed/test_evaluation.py (eval loss = reference, training unchanged) + "
        "distributed/test_omni_audio.py::test_omni_three_modules_collocated (three modules)",
    # packing: Qwen3.5's packed forward is checked in fp64 through the engine by default
    "tests/unit/test_packing.py::test_recurrent_packed_forward_equals_padded_fp64[qwen3_5]":
        "distributed/test_packing.py::test_packed_equals_padded_fp64[qwen3_5-sp2-tp2] (+ the "
        "negative control without the state reset)",
    # the fp64 layout matrix: one row per family by default
    "tests/distributed/test_families.py::test_family_is_exact[qwen3_vl-disjoint-sp1dp1-tp2dp2]":
        "test_family_is_exact[qwen3_vl-collocated-sp2dp1-tp2dp1]",
    "tests/distributed/test_families.py::test_family_is_exact[qwen2_5_vl-disjoint-sp2dp2-tp2dp1]":
        "test_family_is_exact[qwen2_5_vl-collocated-sp2dp1-tp2dp1], test_pipelined_schedule_is_exact",
    "tests/distributed/test_parity.py::test_same_loss_and_gradients_fp32[disjoint-2v-1t]":
        "test_same_loss_and_gradients_fp32[disjoint-1v-2t]",
    "tests/distributed/test_parity.py::test_same_loss_and_gradients_fp32[collocated-sp2-tp2]":
        "test_same_loss_and_gradients_fp32[disjoint-1v-2t]",
    "tests/distributed/test_ulysses.py::test_matches_stock_outputs_and_grads[qwen2_vl-4]":
        "test_matches_stock_outputs_and_grads[qwen2_vl-2] and the other families at SP 4",
    "tests/distributed/test_ulysses.py::test_matches_stock_outputs_and_grads[qwen2_5_vl-1]":
        "test_matches_stock_outputs_and_grads[qwen2_5_vl-2], [qwen2_5_vl-4] and the other families at SP 1",
    "tests/distributed/test_ulysses.py::test_matches_stock_outputs_and_grads[qwen2_vl-1]":
        "test_matches_stock_outputs_and_grads[qwen2_vl-2] and the other families at SP 1",
    # LoRA / per-module tuning
    "tests/distributed/test_tuning.py::test_lora_resume_and_export_merged_or_adapter":
        "test_lora_parity_fp64[sp2-tp2]; export: distributed/test_checkpoint, test_moe_export",
    "tests/distributed/test_tuning.py::test_tuning_parity_fp64[per-module-lr-sp2-tp2]":
        "test_tuning_parity_fp64[frozen-vision-sp2-tp2]",
    "tests/distributed/test_tuning.py::test_tuning_parity_fp64[frozen-llm-disjoint-1v-2t]":
        "test_tuning_parity_fp64[frozen-vision-sp2-tp2]",
    # precision, tied embeddings, text SP
    "tests/distributed/test_precision.py::test_bf16_mixed_resume_is_exact":
        "test_bf16_mixed_masters_equal_the_reference; resume: distributed/test_checkpoint",
    "tests/distributed/test_tied_embeddings.py::test_tied_directory_resume_at_another_layout_and_export":
        "test_tied_embeddings_parity_fp64; resume at another layout: distributed/test_checkpoint",
    "tests/distributed/test_text_sp.py::test_text_sequence_parallel_is_exact_fp64[qwen2_vl-disjoint-sp1dp1-tp2dp1-sp-checkpointing]":
        "test_text_sequence_parallel_is_exact_fp64[...-sp-packing]; checkpointing: test_activation_checkpointing_is_exact",
    "tests/distributed/test_text_sp.py::test_text_sequence_parallel_is_exact_fp64[qwen3_vl-collocated-sp2dp2-tp2dp2-sp-plain]":
        "test_text_sequence_parallel_is_exact_fp64[qwen2_5_vl-collocated-sp2dp1-tp2dp1-sp-packing]",
    "tests/distributed/test_text_sp.py::test_text_sequence_parallel_fp32_within_parity_tolerance":
        "the fp64 text-SP case",
    # data loading and sharded loading
    "tests/distributed/test_loader.py::test_loader_decodes_once_and_matches_the_sampler[collocated_sp2dp2_tp2dp2-True-75-cost]":
        "test_loader_decodes_once_and_matches_the_sampler[collocated_sp2_tp2-True-None-cost]",
    "tests/distributed/test_evaluation.py::test_eval_loss_matches_reference_and_leaves_training_unchanged[disjoint-1v-2t]":
        "...[collocated-sp2-tp2], [collocated-dp2]",
    "tests/distributed/test_sharded_loading.py::test_sharded_directory_first_step_parity_fp64[disjoint-1v-2t]":
        "test_sharded_directory_first_step_parity_fp64[collocated-sp2-tp2]",
    "tests/distributed/test_sharded_loading.py::test_each_rank_holds_only_its_shards_bit_identical[collocated-sp2-tp2-directory]":
        "test_each_rank_holds_only_its_shards_bit_identical[disjoint-1v-2t-config]",
}
