"""The tests ``make test`` (CI's gate, kept under 20 minutes on a 2-core machine) leaves to
``make test-all``: each is a larger or further variant of a mechanism a cheaper test of the gate
already exercises, named beside it. ``tests/conftest.py`` marks them ``extended`` by node-id prefix
and fails the collection of the whole suite if a prefix here matches no test (a renamed test must
not silently leave the list, nor the gate). A parametrization that splits one test between the gate
and the rest marks itself (``tests/integration/test_verdict_runs.py``: seed 0 of every scenario x
strategy in the gate, the other seeds ``extended``).

Measured with ``--durations`` (2 workers, this machine): the whole suite took 36.5 min, 71.6
CPU-min; the tests listed here about 33 CPU-min of it (docs/tests.md).
"""
from __future__ import annotations

# node-id prefix -> the cheaper test in the gate that covers its mechanism
EXTENDED: dict[str, str] = {
    # fidelity: refits all six fitted constants (5.5 min); the gate refits one under --holdout and
    # checks every run's error (test_a_fitted_stack_fraction_is_refitted_..., test_required_cases_all_run)
    "tests/integration/test_fidelity.py::test_fits_lists_every_fitted_constant_with_its_cases":
        "test_fidelity.py::test_a_fitted_stack_fraction_is_refitted_without_the_held_out_runs",
    # XLA runs our exported shardings: the gate keeps mlp, transformer (bp, bp+mp+z3) and inference
    "tests/xla/test_interop_all.py::test_xla_runs_the_exported_shardings_to_our_numbers[unet-":
        "test_interop_all.py [transformer-bp+mp+z3-batch.model]",
    "tests/xla/test_interop_all.py::test_xla_runs_the_exported_shardings_to_our_numbers[gns-":
        "test_interop_all.py [transformer-bp+mp+z3-batch.model]",
    # every collective schedule over MPI at larger layouts: the gate keeps 2x4 block and 4x1 block
    "tests/mpi/test_collectives_mpi.py::test_schedules_over_mpi[16-1-cyclic-True]": "[2-4-block-True]",
    "tests/mpi/test_collectives_mpi.py::test_schedules_over_mpi[8-4-block-False]": "[2-4-block-True]",
    "tests/mpi/test_collectives_mpi.py::test_schedules_over_mpi[4-4-cyclic-True]": "[4-1-block-True]",
    "tests/mpi/test_collectives_repeat.py::test_repeated_schedules_bit_exact[4-2-cyclic]": "[3-2-block]",
    "tests/mpi/test_algorithms_mpi.py::test_new_algorithms_bit_identical_over_mpi[8-2-cyclic]": "[4-4-block]",
    "tests/mpi/test_mpi_mesh.py::test_scenario_strategy_equals_jax[16dev-4perrank-batch=4,model=4-mlp-bp-torus]":
        "test_mpi_mesh.py [16dev-4perrank-batch=4,model=4-transformer-bp-torus]",
    "tests/mpi/test_zoo_mpi.py::test_zoo_strategy_over_mpi_equals_jax_and_local_mesh[unet-":
        "test_zoo_mpi.py [gns-bp-batch.model-4dev-1perrank] and the unet tier in process",
    "tests/mpi/test_pipeline_context_mpi.py::test_over_mpi_equals_local_mesh_and_jax[circular-4x1]":
        "[bp+mp+pp-2x4] over MPI; test_pipeline.py [circular-bp+pp] on the local mesh",
    "tests/mpi/test_microbatches_mpi.py::test_microbatched_step_over_mpi_equals_local_mesh_and_jax[bp+mp+z3]":
        "[bp+mp] over MPI; test_microbatches.py every strategy in process",
    "tests/mpi/test_bf16_mpi.py::test_bf16_mpi_equals_local_mesh[ring-batch+model-batch=2,model=2-4dev-1perrank]":
        "[ring-batch-batch=4-4dev-1perrank]",
    # real model libraries: the gate keeps 10 of the 21 (HF GPT-2, Llama, BERT, BART; penzai llama, gemma,
    # GPT-NeoX; equinox; haiku's layer stack; keras), issue 25's floor
    "tests/integration/test_real_model_libraries.py::test_a_real_library_model_verifies_with_the_expected_"
    "collectives[hf-gpt-neo-": "[hf-gpt2-*]",
    "tests/integration/test_real_model_libraries.py::test_a_real_library_model_verifies_with_the_expected_"
    "collectives[hf-mistral-": "[hf-llama-*]",
    # five more HF models (issue 25's other models): 64-87 s for each one's four tests at load average
    # 7.5 on 2 cores, where the gated hf-bert took 56 s and hf-gpt2 32 s; each beside gated models of
    # the same layout and mechanisms
    **{f"tests/integration/test_real_model_libraries.py::test_a_real_library_model_verifies_with_the_expected_"
       f"collectives[hf-{m}-": gated for m, gated in (
           ("opt", "[hf-bart-*] (the same nn.Dense layout, decoder only)"),
           ("bloom", "[hf-llama-*], [hf-gpt2-*] (the fused q|k|v)"),
           ("distilbert", "[hf-bert-*] (post-LayerNorm encoder)"),
           ("vit", "[hf-bert-*]; test_conv.py (the patch convolution)"),
           ("whisper", "[hf-bart-*] (seq2seq, cross-attention); test_conv.py (its 1-d convolutions)"))},
    # more libraries' forms (real_models_more.py): the gate keeps keras-lm and haiku-layer-stack (the two
    # libraries new to the tier); these repeat a library or a mechanism the gate has
    **{f"tests/integration/test_real_model_libraries.py::test_a_real_library_model_verifies_with_the_expected_"
       f"collectives[{m}-": gated for m, gated in (
           ("haiku-lm", "[haiku-layer-stack-*] (haiku's transform), [keras-lm-*] (attention with a heads axis)"),
           ("nnx-scan-remat", "[haiku-layer-stack-*] (a scanned layer stack); test_auto_flax.py (flax)"),
           ("penzai-llama-stack", "[penzai-llama-*] (the same model unstacked), [haiku-layer-stack-*]"),
           ("equinox-rope", "[equinox-lm-*]; test_primitives_of_flax_optax_equinox.py"))},
    # the automatic search against every manual strategy on the larger meshes
    "tests/integration/test_auto_scenarios.py::test_bp_auto_is_priced_no_higher_than_any_manual_strategy[gns-full-4-pays]":
        "[gns-tiny-2]",
    "tests/integration/test_auto_scenarios.py::test_bp_auto_is_priced_no_higher_than_any_manual_strategy[unet-tiny-4-pays]":
        "[transformer-small-2], [mlp-small-2]",
    "tests/integration/test_auto_scenarios.py::test_bp_auto_is_priced_no_higher_than_any_manual_strategy[unet-tiny-2]":
        "[transformer-small-2], [mlp-small-2]",
    "tests/integration/test_auto.py::test_transformer_bp_auto_finds_megatron_or_cheaper[4-None]": "[2-None]",
    "tests/integration/test_zoo_priced.py::test_zoo_strategy_is_priced_by_both_models[unet-bp+auto-":
        "[transformer-bp+auto-batch.model-tpu-v4]",
    # transformer options: the gate verifies each option alone; the pairwise combinations are here
    **{f"tests/integration/test_transformer_shapes.py::test_option_partitions_and_verifies[kv_heads={k},":
       "test_option_partitions_and_verifies[<one option>]" for k in (1, 2, 4)},
    "tests/integration/test_verdict_runs.py::test_wide_batch_reduction_verifies_over_seeds":
        "test_large_reductions_verify",
    # UNet in process: the gate keeps bp against jax and the bf16 dtypes of the other scenarios
    "tests/integration/test_unet.py::test_bf16_spatial_matches_jax": "test_unet.py::test_strategy_matches_jax",
    "tests/integration/test_unet.py::test_tiny_step_trains": "test_unet.py::test_strategy_matches_jax",
    "tests/integration/test_ring_attention.py::test_the_ring_is_causal_attention[4-4-2]": "[8-2-1]",
    "tests/integration/test_pipeline.py::test_a_pipelined_step_is_the_unpipelined_model[circular]":
        "[gpipe]; test_a_pipeline_verifies_on_the_local_mesh[circular-bp+pp]",
    "tests/integration/test_emb.py::test_transformer_emb_strategies_verify_and_move_no_vocab_sized_value[bp+emb-extra2]":
        "[bp+emb-extra0]",
    "tests/unit/test_routes_agree.py::test_router_route_and_route_matrix_agree[4x4x16-open-z]": "[v4-4x4x16]",
    "tests/unit/test_routes_agree.py::test_router_follows_topology_route_unless_a_link_failed[4x4x16-open-z]":
        "the same test on the smaller topologies",
    "tests/unit/test_routes_agree.py::test_torus_routes_are_dimension_order_shortest_way_ties_plus[4x4x16-open-z]":
        "[v4-4x4x16]",
    # the DES validation: the gate runs the quick suite through the CLI, the 16 overlap cases on the
    # DES's own network (test_des_engine_network.py) and the mutation catalogue (test_mutations.py);
    # the whole default suite (88 cases) here and in benchmarks/ (partir-emu validate)
    "tests/integration/test_des_validate.py::test_default_validation_suite":
        "test_des_validate.py::test_validate_cli_quick_suite, test_des_engine_network.py, test_mutations.py",
    # the verdict on UNet and bf16 transformer steps (the gate verifies both in test_unet.py and
    # test_transformer_shapes.py::test_bf16_*); the 1024-device reduction (the gate keeps the verdict's
    # allowance tests in tests/unit/test_verdict.py)
    "tests/integration/test_verdict_runs.py::test_every_strategy_of_every_scenario_verifies_over_seeds[unet-":
        "test_unet.py::test_strategy_matches_jax",
    "tests/integration/test_verdict_runs.py::test_every_strategy_of_every_scenario_verifies_over_seeds"
    "[transformer-precision=bf16-": "test_transformer_shapes.py::test_bf16_partitions_and_verifies",
    "tests/integration/test_verdict_runs.py::test_large_reductions_verify": "tests/unit verdict allowance tests",
    **{f"tests/integration/test_transformer_shapes.py::test_option_partitions_and_verifies[{o}]":
       "the other single options and test_bf16_partitions_and_verifies (every option at once)"
       for o in ("remat=op", "remat=op,attention=flash,mlp=swiglu", "remat=minimal", "remat=dots", "mlp=relu",
                 "kv_heads=2", "bias=0", "remat=selective,attention=flash")},
    "tests/xla/test_interop_all.py::test_xla_runs_the_exported_shardings_to_our_numbers[transformer-bp+mp+z2-pod":
        "test_interop_all.py [transformer-bp+mp+z3-batch.model]",
    "tests/xla/test_interop_all.py::test_xla_runs_the_exported_shardings_to_our_numbers[transformer-bp+mp+z3-pod":
        "test_interop_all.py [transformer-bp+mp+z3-batch.model]",
    "tests/xla/test_interop.py::test_reductions_agree_after_normalising[":
        "test_interop_all.py (XLA runs our shardings to our numbers)",
    "tests/mpi/test_mpi_mesh.py::test_scenario_strategy_equals_jax[16dev-1perrank-":
        "test_mpi_mesh.py [8dev-1perrank-*] and [16dev-4perrank-*]",
    "tests/integration/test_auto_flax.py::test_tiny_flax_lm_under_a_memory_limit_shards_model_and_matches_jax":
        "test_auto.py memory-limit tests on the built-in scenarios",
    "tests/integration/test_ring_attention.py::test_ring_attention_verifies_under_cp[pp+cp]": "[cp], [bp+mp+cp]",
    "tests/integration/test_pipeline.py::test_a_pipeline_verifies_on_the_local_mesh[bp+mp+sp+pp+z3]": "[bp+mp+pp]",
    "tests/integration/test_microbatches.py::test_accumulated_gradients_equal_the_full_batch_under_jax[4]": "[2]",
    "tests/integration/test_microbatches.py::test_accumulated_gradients_equal_the_full_batch_under_jax[8]": "[2]",
    # the README's study command (82 s: it lowers t48 for every mesh of 256 chips); the gate keeps the
    # study's own tests (test_study.py: the best equals pricing one by one, the files it writes)
    "tests/unit/test_docs.py::test_the_readme_commands_run[study transformer --size]": "tests/integration/test_study.py",
    "tests/integration/test_unet.py::test_strategy_matches_jax[bp+auto]": "test_unet.py::test_strategy_matches_jax[bp], "
                                                                          "test_auto_scenarios.py (bp+auto)",
    # --- measured again after CI ran the gate in 30 min (tests/extended.py's first list) ---
    "tests/integration/test_random_programs.py::test_random_program_matches_jax_many":
        "test_random_program_matches_jax (60 examples)",
    "tests/integration/test_check_cli.py::test_the_example_claims_hold_and_junit_is_written":
        "test_docs.py [check examples/claims/claims.toml --junit] (the README's command, the same suite)",
    "tests/integration/test_claims_plugin.py::test_the_example_suite_passes_as_shipped":
        "test_docs.py [check examples/claims/claims.toml --junit]; "
        "test_claims_plugin.py::test_a_broken_change_fails_and_update_rewrites_the_baseline",
    **{"tests/integration/test_real_model_libraries.py::test_a_real_library_model_verifies_with_the_expected_"
       f"collectives[{m}-bp+auto]": "[hf-llama-bp+auto] and the model's bp, mp, z3"
       for m in ("hf-gpt2", "hf-bart", "penzai-llama", "penzai-gpt-neox", "equinox-lm")},
    "tests/mpi/test_mpi_mesh.py::test_scenario_strategy_equals_jax[16dev-4perrank-":
        "test_mpi_mesh.py [8dev-4perrank-*] (many devices per rank), [8dev-1perrank-*]",
    "tests/integration/test_auto.py::test_transformer_bp_auto_finds_megatron_or_cheaper[2-None]": "[2-layers_as=loop]",
    "tests/mpi/test_microbatches_mpi.py::": "test_pipeline_context_mpi.py [bp+mp+pp-2x4] (microbatches over MPI); "
                                           "test_microbatches.py every strategy in process",
    "tests/mpi/test_sequence_parallel_mpi.py::test_over_mpi_equals_local_mesh_and_jax[bp+z3":
        "[bp+mp+sp+z3-batch=4,model=2]",
    "tests/integration/test_search_reproducible.py::test_auto_partition_gives_the_same_strategy_however_slow_the_"
    "clock[gns-": "[mlp-batch=2,model=2]",
    **{f"tests/unit/test_routes_agree.py::{t}[v4-4x4x16]": "the same test on the smaller topologies"
       for t in ("test_router_route_and_route_matrix_agree", "test_torus_routes_are_dimension_order_shortest_way_ties_plus")},
    "tests/integration/test_fidelity.py::test_a_fitted_stack_fraction_is_refitted_without_the_held_out_runs":
        "test_fidelity.py::test_holdout_by_source_refits_without_the_held_out_table (the same --holdout on "
        "made-up data), test_the_dcn_fraction_is_fitted_on_the_growth_from_one_slice_and_held_out_by_source",
}


def extended(nodeid: str) -> bool:
    """Whether the test of ``nodeid`` is left to ``make test-all``."""
    return any(nodeid.startswith(p) for p in EXTENDED)
