"""Issue 43 (safety floor, round 3): the probe table. Each item of the issue, and the tests that
probe it; each of them failed before its fix (the commits say how each was seen to fail). The test
below checks that every probe named here exists, so the table cannot quietly lose one."""

from __future__ import annotations

import ast
from pathlib import Path

HERE = Path(__file__).parent

PROBES = {
    "1. no code runs from weights/.metadata, sharded objects, _extra_state, weights/common.pt": [
        "test_checkpoint_safety.py::test_crafted_metadata_runs_no_code_through_any_door",
        "test_checkpoint_safety.py::test_payload_in_a_sharded_object_runs_no_code",
        "test_checkpoint_safety.py::test_crafted_mcore_common_pt_is_refused_by_name",
        "test_checkpoint_safety.py::test_non_empty_extra_state_is_refused_before_transformer_engine_unpickles_it",
    ],
    "2. async saves faster than the writer; a kill at each stage": [
        "test_checkpoint_faults.py::test_saves_faster_than_the_writer",
        "test_checkpoint_faults.py::test_kill_during_an_async_save",
    ],
    "3. export --overwrite replaces only what the export wrote": [
        "test_bad_inputs_round3.py::test_overwrite_refuses_files_the_export_did_not_write",
        "test_bad_inputs_round3.py::test_overwrite_through_a_symlink_refuses_the_same",
        "test_bad_inputs_round3.py::test_an_old_marker_without_a_file_list_is_replaced_only_when_it_holds_export_files",
    ],
    "4. SIGTERM/SIGINT end cleanly, non-zero, never hang; SLURM requeue": [
        "test_checkpoint_faults.py::test_sigterm_during_an_async_save",
        "test_checkpoint_faults.py::test_slurm_requeue_signal",
        "test_checkpoint_faults.py::test_a_rank_that_never_reaches_a_step_boundary_ends_itself",
        "test_checkpoint_faults.py::test_a_stopped_run_leaves_no_deadline_behind",
    ],
    "5. silent acceptance refused before launch": [
        "test_worker_errors.py::test_a_second_run_in_a_checkpoint_directory_in_use",
        "test_worker_errors.py::test_a_run_in_the_same_process_holds_its_directory_until_it_ends",
        "test_worker_errors.py::test_yaml_key_given_twice",
        "test_bad_inputs_round3.py::test_kto_data_of_one_kind_is_refused_before_launch",
        "test_bad_inputs_round3.py::test_kto_data_of_one_kind_is_refused_in_every_file_form",
        "test_bad_inputs_round3.py::test_kto_training_split_of_one_kind_is_refused_at_setup",
        "test_worker_errors.py::test_ckpt_path_last_without_a_checkpoint",
        "test_worker_errors.py::test_ckpt_path_last_if_any",
        "test_bad_inputs_round3.py::test_export_source_that_is_not_a_directory_is_refused",
        "test_bad_inputs_round3.py::test_preprocess_prefix_without_a_file_name_is_refused",
    ],
    "6. one error: line for faults only workers see; exit codes 2 and 1": [
        "test_worker_errors.py::test_nan_gradient_norm",
        "test_worker_errors.py::test_malformed_jsonl_line_past_the_first_records",
        "test_worker_errors.py::test_checkpoint_directory_not_writable",
        "test_worker_errors.py::test_checkpoint_directory_turned_read_only_during_the_run",
        "test_worker_errors.py::test_checkpoint_on_a_full_disk",
        "test_worker_errors.py::test_preprocess_without_the_text_field",
        "test_worker_errors.py::test_preprocess_malformed_line_past_the_first_records",
        "test_verify_sensitivity.py::test_a_tolerance_that_passes_nothing_is_refused",
        "test_verify_sensitivity.py::test_a_model_without_weights_is_refused_before_any_rank",
    ],
    "7. the right key named: GRPO prompt length, widths TP/ETP cannot split": [
        "test_bad_inputs_round3.py::test_grpo_prompt_length_names_the_prompt_data_key",
        "test_bad_inputs_round3.py::test_mlp_width_not_divisible_by_tensor_parallel_is_refused",
        "test_bad_inputs_round3.py::test_expert_width_not_divisible_by_expert_tensor_parallel_is_refused",
        "test_bad_inputs_round3.py::test_width_rules_are_mcores",
    ],
    "8. verify fails on one corrupted weight": [
        "test_verify_sensitivity.py::test_one_corrupted_weight_fails_naming_its_layer",
        "test_verify_sensitivity.py::test_the_corruption_is_what_transformers_sees",
        "test_verify_sensitivity.py::test_bf16_on_cpu_passes_when_exact_and_fails_on_a_wrong_row",
        "test_verify_sensitivity.py::test_exact_checkpoints_pass",
    ],
    "9. verify's reference: eager experts, its own exit code": [
        "test_verify_sensitivity.py::test_a_mixtral_of_odd_expert_width_verifies",
        "test_verify_sensitivity.py::test_a_failing_reference_has_its_own_exit_code",
    ],
    "10. Qwen3-VL mrope_section as transformers reads it": [
        "test_bad_inputs_round3.py::test_qwen3_vl_reads_mrope_section_as_transformers",
        "test_bad_inputs_round3.py::test_qwen2_5_vl_section_transformers_cannot_use_is_refused_before_launch",
    ],
}


def _tests_in(file: str) -> set[str]:
    tree = ast.parse((HERE / file).read_text())
    return {node.name for node in tree.body if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")}


def test_every_item_has_probes_that_exist():
    assert [key.split(".")[0] for key in PROBES] == [str(i) for i in range(1, 11)]
    missing = [probe for probes in PROBES.values() for probe in probes
               if probe.split("::")[1] not in _tests_in(probe.split("::")[0])]
    assert not missing, missing
