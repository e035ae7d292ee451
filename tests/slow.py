"""Which tests are slow: ``make test-fast`` (``pytest -m "not slow"``) leaves them out.

tests/conftest.py marks them (``pytest.mark.slow``) as they are collected;
``tests/test_docs.py`` checks that every name here is a test that exists. A test is
listed when it takes about a second or more on a loaded 2-core machine, starts a
browser, Ray or a subprocess server, or builds a wheel; the quick lane runs the rest in
under two minutes on 2 cores.
"""

#: Modules slow as a whole (a browser, Ray, real servers in subprocesses, the wheel).
SLOW_MODULES = frozenset(
    {
        "test_aiperf_client.py",
        "test_browser.py",
        "test_litellm_client.py",
        "test_gateway_haproxy.py",
        "test_openai_agents_client.py",
        "test_packaging.py",
        "test_plan_ray.py",
        "test_pydantic_ai_client.py",
        "test_scripts_input.py",
        "test_serve_e2e.py",
    }
)

#: Slow tests of the other modules: module -> test function names (every parameter).
SLOW_TESTS: dict[str, frozenset[str]] = {
    "test_agents_sdk.py": frozenset(
        {
            "test_responses_create_streamed_and_not",
            "test_the_agents_page_examples_print_what_the_page_shows",
        }
    ),
    "test_benchkit.py": frozenset(
        {
            "test_server_process_reports_a_server_that_cannot_start",
            "test_server_process_serves_and_stops",
            "test_the_raw_stream_clients_read_a_stream_and_a_refusal_to_their_end",
        }
    ),
    "test_pd_proxy.py": frozenset({"test_three_processes_make_a_1p1d_deployment"}),
    "test_calibrate.py": frozenset(
        {
            "test_the_fit_recovers_efficiency_terms_from_levels_generated_with_them",
        }
    ),
    "test_cli.py": frozenset(
        {
            "test_parsing_loads_no_machinery",
            "test_sim_does_not_import_the_serve_stack",
        }
    ),
    "test_client_load.py": frozenset(
        {
            "test_adaptive_limit_saw_tooths_around_the_servers_capacity",
            "test_cli_writes_summary_rows_and_plot",
            "test_fast_path_agrees_with_full_json_decoding",
        }
    ),
    "test_client_real_server.py": frozenset(
        {
            "test_aimd_client_is_refused_only_by_a_full_queue",
            "test_outcome_counts_match_the_servers_admissions",
        }
    ),
    "test_deploy.py": frozenset(
        {
            "test_the_build_context_builds_the_package_with_the_configs",
            "test_the_healthcheck_passes_on_a_healthy_server_and_fails_otherwise",
        }
    ),
    "test_engine_runs.py": frozenset(
        {
            "test_run_until_is_step_by_step",
        }
    ),
    "test_engine_vector.py": frozenset(
        {
            "test_vectorised_mode_gives_the_same_events",
        }
    ),
    "test_harness.py": frozenset(
        {
            "test_fault_table_applies_to_its_rate_of_streaming_requests_seeded",
            "test_stall_keeps_the_stream_open_until_the_client_leaves",
        }
    ),
    "test_harness_wire.py": frozenset(
        {
            "test_client_exceptions_match_the_documented_table",
            "test_every_mode_on_the_wire_byte_for_byte",
            "test_plain_hypercorn_launch_with_the_harness_and_a_fault_table",
        }
    ),
    "test_openai_api.py": frozenset(
        {
            "test_streamed_text_always_concatenates_to_the_answer",
        }
    ),
    "test_plan.py": frozenset(
        {
            "test_a_job_submitted_after_a_worker_died_is_sent_to_the_new_pool",
            "test_a_job_that_raises_fails_only_its_candidate",
            "test_a_plan_grown_by_one_knob_reuses_every_finished_run",
            "test_a_process_pool_gives_the_same_answer_after_a_worker_is_killed",
            "test_an_interrupted_plan_resumes_from_its_cache",
            "test_plan_does_not_import_the_serve_stack",
            "test_the_command_prints_the_report_and_writes_its_files",
            "test_the_small_plan_finds_rates_and_reports_misfits",
        }
    ),
    "test_plan_scale.py": frozenset(
        {
            "test_max_candidates_raises_the_cap",
            "test_quiet_says_up_front_how_many_simulations_on_stderr",
            "test_the_planner_takes_candidates_from_an_iterator",
        }
    ),
    "test_prefix_cache.py": frozenset(
        {
            "test_blocks_are_conserved_with_shared_prefixes_over_random_runs",
            "test_hit_accounting_is_exact_with_an_unbounded_cache",
            "test_without_hashes_or_with_caching_off_nothing_changes",
        }
    ),
    "test_replay.py": frozenset(
        {
            "test_sessions_resend_the_conversation_and_hit_the_cache",
            "test_sim_writes_the_sessions_it_simulates",
        }
    ),
    "test_serve_agents.py": frozenset(
        {
            "test_auto_calls_a_tool_with_the_configured_probability",
            "test_bad_agent_fields_are_400s_naming_the_field",
            "test_json_schema_answers_validate_and_usage_is_their_length",
        }
    ),
    "test_serve_capacity_dials.py": frozenset(
        {
            "test_lowering_max_num_seqs_cuts_throughput_by_the_roofline_factor",
        }
    ),
    "test_serve_connection.py": frozenset(
        {
            "test_a_keep_alive_connection_serves_a_request_longer_than_the_timeout",
            "test_a_request_head_slower_than_the_deadline_is_answered_408",
            "test_an_idle_h2c_connection_is_closed_like_an_idle_http1_one",
        }
    ),
    "test_serve_dashboard.py": frozenset(
        {
            "test_with_a_control_token_the_dashboard_needs_it_in_the_header_or_the_query",
        }
    ),
    "test_serve_ranks.py": frozenset(
        {
            "test_a_rank_that_cannot_bind_fails_the_start",
            "test_no_rank_outlives_the_parent",
            "test_ranks_serve_restart_and_drain_on_sigterm",
        }
    ),
    "test_serve_hardening.py": frozenset(
        {
            "test_a_burst_is_answered_at_once_admitting_exactly_the_bound",
            "test_a_post_body_not_declared_json_is_a_415",
            "test_a_signal_ends_every_live_stream_with_a_complete_answer",
            "test_a_trickled_body_on_a_real_socket_is_cut_at_the_deadline",
            "test_drain_lets_requests_finish_within_the_grace_period_then_ends_the_rest",
        }
    ),
    "test_serve_hostile.py": frozenset(
        {
            "test_a_plain_hypercorn_worker_exits_when_its_parent_is_killed",
            "test_a_server_out_of_descriptors_logs_quietly_and_accepts_again",
        }
    ),
    "test_serve_http.py": frozenset(
        {
            "test_check_order_validation_model_fit_alive",
        }
    ),
    "test_serve_large_bodies.py": frozenset(
        {
            "test_a_large_non_streaming_body_is_sent_in_bounded_pieces",
            "test_body_pieces_concatenate_to_the_whole_body",
        }
    ),
    "test_serve_lifecycle.py": frozenset(
        {
            "test_disconnected_waiting_request_frees_its_queue_slot_for_another",
        }
    ),
    "test_serve_pacing.py": frozenset(
        {
            "test_a_stream_longer_than_a_minute_is_not_cut",
            "test_request_into_a_server_idle_for_an_hour_is_paced_the_same",
        }
    ),
    "test_serve_saturation.py": frozenset(
        {
            "test_invalid_capacity_change_is_400_and_changes_nothing",
        }
    ),
    "test_sim_capacity.py": frozenset(
        {
            "test_runs_that_keep_up_print_nothing",
        }
    ),
    "test_sim_cli.py": frozenset(
        {
            "test_same_seed_same_numbers_other_seed_differs",
            "test_subprocess_error_is_one_line_exit_1",
            "test_subprocess_run_exits_zero_and_writes_json",
        }
    ),
    "test_sim_prefix.py": frozenset(
        {
            "test_caching_off_computes_every_prompt_and_says_so",
            "test_routers_spread_sessions_and_report_per_replica",
        }
    ),
    "test_sim_records.py": frozenset(
        {
            "test_a_lazily_fed_open_loop_runs_as_if_submitted_up_front",
            "test_events_taken_in_runs_give_the_run_of_one_event_at_a_time",
            "test_the_request_csv_is_the_one_written_from_held_records",
        }
    ),
}
