"""``make mutate``: mutation testing of the per-step rule modules with mutmut, one module at a time.

Each module runs in its own copy of the repository under ``build/mutate/<module>/`` with its own
mutmut configuration, so its mutants only run the few fast test files that cover it (mutmut reads
one ``[tool.mutmut]`` table per directory; a single shared table would send every mutant of the
speculative step through RAPID's slow end-to-end decodes). Within a module only the rule functions
are mutated (``run_*`` decode loops are the scheduler's business and are tested end to end).

    python tools/mutate.py                 # every module
    python tools/mutate.py pced scores     # some modules
    MUTATE_CHILDREN=2 python tools/mutate.py          # parallel mutants (default 2)
    MUTATE_WORK=build/mutate-b python tools/mutate.py  # another work folder (two runs side by side)
    MUTATE_SURVIVORS_OF=build/mutate python tools/mutate.py soft_nbce  # after adding tests: rerun survivors only

Prints, per module, killed / survived / other mutants and every survivor's diff; equivalent
mutants are judged by a person and listed in docs/testing.md. Not part of ``make test`` or CI.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORK = Path(os.environ.get("MUTATE_WORK", ROOT / "build" / "mutate"))
MUTMUT = Path(sys.executable).parent / "mutmut"


@dataclass(frozen=True)
class Target:
    """One module: its file, the functions to mutate (mutmut name patterns) and the tests that cover them."""

    path: str
    functions: tuple[str, ...]
    tests: tuple[str, ...]


TARGETS = {
    "scores": Target("ctx_integrations/retrieval/scores.py", ("*",), ("tests/test_scores.py",)),
    "pced": Target("ctx_integrations/engine/modes/pced.py",
                   ("x_jensen_shannon*", "x_relevance_weights*", "x_contrasted*", "x_max_fused*", "x_padded_rows*",
                    "xǁPCEDFusionǁ*"),
                   ("tests/test_core_fusion.py", "tests/test_pced_word_switch.py", "tests/test_priors.py",
                    "tests/test_pced_batched.py", "-k",
                    "not answer_equals_a_reference and not one_document_is and not mode and not ape_bias")),
    "priors": Target("ctx_integrations/engine/modes/priors.py", ("*",),
                     ("tests/test_priors.py", "tests/test_query_likelihood.py", "-k", "not mode and not ape_bias")),
    # PCED's query_likelihood: the rule's side, the job's runs and sum, the question's span in the suffix
    # (fuse_batch is the pced target's; what it gained here is where the padded priors are built, a no-op on the CPU)
    "pced_likelihood": Target("ctx_integrations/engine/modes/pced.py",
                              ("xǁPCEDFusionǁgiven_likelihood*", "xǁPCEDFusionǁwants_likelihood*",
                               "xǁPCEDFusionǁ__init__*"),
                              ("tests/test_query_likelihood.py", "tests/test_core_fusion.py", "tests/test_priors.py",
                               "-k", "not mode and not ape_bias")),
    "likelihood_job": Target("ctx_integrations/engine/core/jobs.py",
                             ("x_prompt_runs*", "x_sequence_loglik*", "xǁFusedJobǁ_rule_for*", "xǁFusedJobǁpropose*",
                              "xǁFusedJobǁ__init__*"),
                             ("tests/test_query_likelihood.py", "tests/test_scheduler_batched.py", "-k",
                              "not proposal")),
    "question_span": Target("ctx_integrations/engine/core/layout.py",
                            ("xǁPromptLayoutǁquestion_span*", "xǁPromptLayoutǁ_bare_suffix_ids*"),
                            ("tests/test_query_likelihood.py",)),
    "word_pieces": Target("ctx_integrations/engine/core/word_pieces.py", ("*",), ("tests/test_pced_word_switch.py",)),
    "ape": Target("ctx_integrations/engine/modes/ape.py", ("x_ape_attention*", "x_check_knobs*", "xǁApeLayoutǁ*",
                                                             "x_ape_plan*", "xǁApeRowAttentionǁ*",
                                                             "x_merge_softmaxes*", "x_check_model*"),
                  ("tests/test_ape.py", "tests/test_ape_attribution.py", "tests/test_row_attention.py",
                   "-m", "not slow")),
    "row_attention": Target("ctx_integrations/engine/core/row_attention.py", ("*",),
                            ("tests/test_row_attention.py", "tests/test_ape.py", "-m", "not slow")),
    "model_catalog": Target("ctx_integrations/model_catalog.py",
                            ("x_catalog_entry*", "x_pip_download*", "x__append_member*", "x_fetch*",
                             "x_verified_path*"),
                            ("tests/test_model_catalog.py",)),
    "file_hashes": Target("ctx_integrations/file_hashes.py", ("*",), ("tests/test_file_hashes.py",)),
    "ippd": Target("ctx_integrations/engine/modes/ippd.py", ("*",), ("tests/test_ippd.py", "-m", "not slow")),
    # FlexAttention traces the block mask's mask_mod with dynamo, which cannot trace mutmut's trampolines (a
    # ContextVar read): the flex kernel's tests are left out, and its parity with the rule is tested by make test.
    # The arena's bookkeeping (slots, merges, leaves, rewinds, copies) against tests without a model: each checks
    # every column of every slot on hand-made tensors in milliseconds (~480 mutants, a run of about an hour)
    "rows": Target("ctx_integrations/engine/core/rows.py",
                   ("x_visible*", "x_visibility__*", "x__pad*", "x_slot_bucket*", "x__room*",
                    *(f"xǁRowPoolǁ{name}*" for name in ("__post_init__", "rows", "slot_count", "capacity", "width",
                                                         "build", "merge", "keep_rows", "_free_slots", "resize_slots",
                                                         "_compact", "rewind", "select", "take_columns", "_reserve",
                                                         "_padded", "_trimmed", "slot_lengths"))),
                   ("tests/test_row_arena.py", "tests/test_rows.py", "tests/test_compiled_step.py", "-k",
                    "test_row_arena or build_places or lengths_are_counted or visibility_and or dropping_every "
                    "or document_marks or slot_buckets")),
    # The pool's forward (the eager one and the decode step's pure function) and its cache layer, against the tiny
    # model's rows answering as if alone (the eager kernel's tests)
    "rows_forward": Target("ctx_integrations/engine/core/rows.py",
                           ("xǁRowPoolǁforward*", "xǁRowPoolǁ_eager_forward*", "x_step_mask*", "x_decode_step*",
                            "xǁPoolLayerǁ*"),
                           ("tests/test_rows.py", "tests/test_row_arena.py", "-k", "not flex")),
    # one forward per token count (in place, apart), joining rows made the pool or merged in, errors reported
    "runner": Target("ctx_integrations/engine/core/runner.py", ("xǁModelRunnerǁ*",),
                     ("tests/test_model_runner.py", "tests/test_rows.py", "-k", "test_model_runner or run_apart")),
    # documents prepared once: the memo of their tokens and keys, an LRU bounded by tokens
    "prepared": Target("ctx_integrations/engine/core/prepared.py", ("*",),
                       ("tests/test_prepared_requests.py", "-k",
                        "memo or prepared_twice or over_the_whole or cold_request")),
    # one answer as it is decoded: offset-based incremental text, stop strings searched in the new text, the emitter
    "decoding": Target("ctx_integrations/engine/core/decoding.py",
                       ("xǁIncrementalTextǁ*", "xǁStopCriteriaǁfirst_stop*", "xǁStopCriteriaǁcut*", "xǁEmitterǁ*"),
                       ("tests/test_emitter.py", "tests/test_prepared_requests.py", "tests/test_answer_handle.py",
                        "-k", "test_emitter or incremental or stop_string or streams_exactly or test_answer_handle")),
    # the batched pick, greedy and sampled: each request's token, winner and scores from one batched rule evaluation,
    # each sampled request's noise from its own generator; the identity rule's batch; a failed batch's generators
    "batch_proposals": Target("ctx_integrations/engine/core/decoding.py",
                              ("x_batch_proposals*",
                               "x_generators_kept*", "xǁSingleStreamǁ*", "xǁTokenSamplerǁbatch_knobs*",
                               "xǁTokenSamplerǁplain*"),
                              ("tests/test_pced_batched.py", "tests/test_sampled_batch.py")),
    # the batched rules' shared padding: each request's streams padded to the widest with copies of its first row
    "padded_streams": Target("ctx_integrations/engine/core/decoding.py", ("x_padded_streams*",),
                             ("tests/test_pced_batched.py", "tests/test_soft_nbce_batched.py")),
    # the compile mode's checks and resolution, the compiled step's options, static arena, symbolic shapes, step
    # thread and fallback (the engine-level Dynamo tests over many requests, the slowest, are left out)
    "compiled_step": Target("ctx_integrations/engine/core/compiled_step.py", ("*",),
                            ("tests/test_compiled_step.py", "-k",
                             "not one_graph and not another_bucket and not slot_buckets "
                             "and not several_tokens")),
    # the pool's attention: each query head over its own key/value head, a packed query's row of the mask
    "grouped_sdpa": Target("ctx_integrations/engine/core/grouped_attention.py", ("x_grouped_sdpa*",),
                           ("tests/test_compiled_step.py", "-k", "grouped_attention or own_key_value")),
    # the pool's attention on the runner's kernel: FlexAttention, grouped SDPA or the model's own
    "step_attention": Target("ctx_integrations/engine/core/grouped_attention.py", ("x_step_attention*",),
                             ("tests/test_compiled_step.py", "-k",
                              "flex_kernel or own_key_value or chosen_by_the_runners_kernel")),
    # switching a model's attention per call: the full check once per model and name, then the shared config
    "attention_swap": Target("ctx_integrations/engine/core/attention_swap.py", ("*",),
                             ("tests/test_attention_swap.py",)),
    # the CUDA graph trees' state in the step's thread, and where the guarded step imports them (torch 2.11 and 2.13)
    "graph_tree_state": Target("ctx_integrations/engine/core/compiled_step.py",
                               ("x_cudagraph_trees_in_this_thread*", "xǁGuardedStepǁ*"),
                               ("tests/test_compiled_step.py", "-k", "thread or guarded or failures")),
    # a flex kernel that cannot be built: smaller tiles, then SDPA in query chunks, remembered per kernel kind
    "flex_fallback": Target("ctx_integrations/engine/core/flex.py", ("x__kernel_kind*", "x__recover*", "x_run_flex*",
                                                                    "x_block_mask*"),
                            ("tests/test_core_flex.py", "-k", "not windowed")),
    # the batch-invariant CPU kernels: the GEMM height probe, the padding, the math attention's mask
    "batch_invariant": Target("ctx_integrations/engine/core/batch_invariant.py", ("*",),
                              ("tests/test_batch_invariant_kernels.py",)),
    # the scheduler's decisions (admission by bytes, the row table, retirement), driven by a fake runner
    # what Engine.submit returns: the pieces buffer and the handle's readers (sync, async, late, cancelling)
    "handle": Target("ctx_integrations/engine/core/handle.py", ("*",), ("tests/test_answer_handle.py",)),
    "step": Target("ctx_integrations/engine/core/step.py", ("*",), ("tests/test_scheduler_core.py",)),
    # the step's token choice (proposals batched by key, one read back) and the sampler's on-device draw
    "choice": Target("ctx_integrations/engine/core/choice.py", ("*",),
                     ("tests/test_choice.py", "tests/test_scheduler_core.py", "tests/test_host_reads.py")),
    "sampler": Target("ctx_integrations/engine/core/decoding.py",
                      ("xǁTokenSamplerǁpick*", "xǁTokenSamplerǁ__init__*", "x_sampling_probs*", "x_race_noise*",
                       "x_race_noises*", "x_race_winner*"),
                      ("tests/test_sampling_knobs.py", "tests/test_sampling_params.py",
                       "tests/test_speculative_rows.py", "tests/test_sampled_batch.py", "-k",
                       "not cancel and not failing")),
    "scheduler": Target("ctx_integrations/engine/core/scheduler.py",
                        ("xǁSchedulerǁ_plan*", "xǁSchedulerǁ_build*", "xǁSchedulerǁ_take_ready*",
                         "xǁSchedulerǁ_reserved*", "xǁSchedulerǁ_retire*", "xǁSchedulerǁ_consume*",
                         "xǁSchedulerǁ_waiting*", "xǁSchedulerǁ_step*", "xǁSchedulerǁ_count*",
                         "xǁSchedulerǁ_follow_up*", "xǁSchedulerǁ_bytes_needed*"),
                        ("tests/test_scheduler_core.py",)),
    "soft_nbce": Target("ctx_integrations/engine/modes/soft_nbce.py",
                        ("x_check_rule*", "x_nucleus_mask*", "x_nucleus_logprobs*", "x_nucleus_entropy*",
                         "x_paper_contrast*", "x_chunk_sum*", "x_chunk_softmax*", "x_paper_fusion*",
                         "x_truncated_entropy*", "x_contrast_chunks*", "xǁKnobsǁ*", "xǁSoftNBCEFusionǁ*",
                         "xǁNBCEFusionǁ*", "xǁPCWFusionǁ*"),
                        ("tests/test_soft_nbce.py", "tests/test_soft_nbce_streams.py",
                         "tests/test_soft_nbce_batched.py", "-m", "not slow")),
    # Soft-NBCE's default: the prior and the whole support only where the scores rank the chunks
    "routed_rule": Target("ctx_integrations/engine/modes/soft_nbce.py",
                          ("x_check_gamma*", "x_support_rho*", "x_routed_rule*"),
                          ("tests/test_priors.py", "-k", "soft_nbce")),
    # Soft-NBCE's query_likelihood: the rule takes the likelihood, and the mode routes by it even on equal scores
    "soft_nbce_likelihood": Target("ctx_integrations/engine/modes/soft_nbce.py",
                                   ("xǁSoftNBCEFusionǁgiven_likelihood*", "xǁSoftNBCEFusionǁwants_likelihood*",
                                    "xǁSoftNBCEFusionǁ__init__*", "x_routed_rule*", "xǁKnobsǁof*"),
                                   ("tests/test_query_likelihood.py", "tests/test_priors.py", "tests/test_soft_nbce.py",
                                    "tests/test_soft_nbce_batched.py", "-m", "not slow", "-k",
                                    "not mode and not ape_bias")),
    # Soft-NBCE's default question-likelihood weight: set only where the scores rank the chunks (run_soft_nbce, which
    # applies it, is under @register_mode, and mutmut leaves decorated functions alone)
    "soft_nbce_default": Target("ctx_integrations/engine/modes/soft_nbce.py",
                                ("x_default_query_likelihood*", "x_scores_rank*"),
                                ("tests/test_query_likelihood.py", "tests/test_priors.py",
                                 "tests/test_hardening_inputs.py", "-k", "soft_nbce or likelihood or prior")),
    # the pool's masks for sliding-window models: which layers slide, and the window on the virtual positions (the flex
    # kernel's test is left out: FlexAttention traces its mask_mod with Dynamo, which cannot trace mutmut's
    # trampolines; the same in_window rule is killed through the eager masks)
    "windows": Target("ctx_integrations/engine/core/windows.py", ("*",),
                      ("tests/test_sliding_windows.py", "-k", "not flex_kernel")),
    # RAPID's rows in the shared batch: the row bookkeeping (its jobs and channel are tested end to end: each
    # mutant there costs a minute of RAPID decodes, ~500 mutants); the on-device verdict
    "speculative_rows": Target("ctx_integrations/engine/modes/speculative_rows.py", ("xǁSequenceRowǁ*",),
                               ("tests/test_speculative_rows.py", "-k",
                                "common_prefix or held_a_longer or diverges_early or fed_again "
                                "or runs_in_the_shared_batch")),
    # RAPID's drafter row (the distribution each draft is drawn from and verified against) and the verdict's read
    # back (the emitted tokens and their trace scores), through tiny-model decodes of about a second each
    "rapid_rows": Target("ctx_integrations/engine/modes/speculative_rows.py",
                         ("xǁDraftRowǁ*", "xǁRapidJobǁ_propose_verdict*", "xǁRapidJobǁbatch_key*",
                          "xǁRapidJobǁpropose_batch*", "xǁRapidJobǁ_verdicts*", "xǁDraftJobǁbatch_key*",
                          "xǁDraftJobǁpropose_batch*", "x_verdict_values*"),
                         ("tests/test_speculative_rows.py", "tests/test_rapid.py", "-k",
                          "(test_speculative_rows and not cancelled and not cannot_run) or tail_rule_reaches")),
    # the seal of format_docs blocks: only blocks this process wrote come back out of a prompt as documents
    "boundaries": Target("ctx_integrations/langchain/boundaries.py", ("*",),
                         ("tests/test_attack_langchain.py", "tests/test_langchain_lcel_rag.py",
                          "tests/test_attack_surfaces.py", "-k", "seal or round_trips or replayed or pasted_twenty")),
    # structured output's JSON-schema check: the keyword table, the walk, the nesting limit, the local $ref's target
    "schema_support": Target("ctx_integrations/engine/core/schema_support.py", ("*",),
                             ("tests/test_schema_support.py", "tests/test_attack_schema.py", "-k",
                              "not server and not answered_validly and not before_any_answer and not docs")),
    # structured output's own rules: the schema's text, the bounds of what it leaves unbounded, the format's kind and
    # source, the mask (the compiler's pool is tests/test_attack_compile.py's, end to end; the embedded model's and
    # the slowest modes' decodes are left out of this selection; response_format's reading is test_facade's)
    "structured": Target("ctx_integrations/engine/core/structured.py",
                         ("x__schema_text*", "xǁSchemaBoundsǁ*", "x_narrowed_schema*", "xǁStructuredOutputǁ*",
                          "x_format_source*", "x__choice_grammar*", "x_pack_bits*", "xǁTokenConstraintǁ*"),
                         ("tests/test_structured_output.py", "tests/test_tools.py", "tests/test_facade.py",
                          "tests/test_schema_support.py", "-k",
                          "not embedded_model and not chat_ippd and not concat and not map_reduce and not "
                          "required_and_named and not native_formats and not docs")),
    "kv_codec": Target("ctx_integrations/engine/core/kv_codec.py", ("*",), ("tests/test_kv_codec.py",)),
    # tool calling: the call format read from the template, the structural tag, the calls (markup, bare or fenced
    # JSON) and a cut call read back, the stream filter (tiny-model tests; the embedded model's one is left out)
    "tools": Target("ctx_integrations/engine/core/tools.py", ("*",),
                    ("tests/test_tools.py", "-k", "not embedded_model")),
    # the server's rules: which chat fields are refused, and whose requests carry the API key
    "unsupported": Target("ctx_integrations/serve/unsupported.py", ("*",),
                          ("tests/test_serve_openai_api.py", "-k", "refus or not_implement or ask_for_nothing")),
    "auth": Target("ctx_integrations/serve/auth.py", ("*",),
                   ("tests/test_serve_openai_api.py", "tests/test_attack_surfaces.py", "-k", "api_key")),
    # the access log: one line per request, with the query's credentials redacted
    "access_log": Target("ctx_integrations/serve/access_log.py", ("*",),
                         ("tests/test_serve_openai_api.py", "tests/test_attack_surfaces.py", "-k", "access_log")),
    "machine": Target("ctx_integrations/engine/core/machine.py", ("*",), ("tests/test_machine.py",)),
    # the server's limits: header and body sizes at their boundaries, the read deadline, the limits' validation
    "limits": Target("ctx_integrations/serve/limits.py", ("*",), ("tests/test_serve_limits.py",)),
    # which GPUs a Ray replica reserves, how many replicas a cluster holds, which device a replica uses
    "gpu_placement": Target("ctx_integrations/serve/gpu_placement.py", ("*",), ("tests/test_gpu_placement.py",)),
    # the CLI's engine options: which flags become keywords of Engine.from_pretrained
    "cli_options": Target("ctx_integrations/cli.py", ("x_engine_options*",),
                          ("tests/test_engine_options.py", "tests/test_cli_fast.py")),
    # the engine's settings: their checks, Engine's keywords over a config, the flags generated from the fields,
    # sizes read from the command line (byte_count moved here from cli.py)
    "config": Target("ctx_integrations/engine/core/config.py", ("*",),
                     ("tests/test_engine_config.py", "tests/test_engine_options.py", "tests/test_compiled_step.py",
                      "-k", "test_engine_config or test_engine_options or every_compile_mode")),
    "greedy_verdict": Target("ctx_integrations/engine/modes/speculative.py", ("x_greedy_verdict*",),
                             ("tests/test_speculative_rows.py", "-k", "verdict")),
    "sampled_verdict": Target("ctx_integrations/engine/modes/speculative.py",
                              ("x_sampled_verdict*", "x_verdict_noise*"),
                              ("tests/test_speculative_rows.py", "-k", "verdict")),
    "speculative": Target("ctx_integrations/engine/modes/speculative.py", ("*",),
                          ("tests/test_rapid_eta.py", "tests/test_speculative_step.py", "tests/test_rapid.py",
                           "tests/test_speculative_rows.py", "-m", "not slow", "-k",
                           "test_speculative_step or test_rapid_eta or residual or tail or nucleus or verify or eta "
                           "or top_p or rule or draft_head")),
    # ingestion: what is text (the encoding rules), and splitting into passages (limits, packing, linear work)
    "reading": Target("ctx_integrations/retrieval/reading.py",
                      ("x_decode_text*", "x__bom_codec*", "x__legacy*", "x__checked*", "x__is_pdf*"),
                      ("tests/test_retrieval_reading.py",)),
    "passages": Target("ctx_integrations/retrieval/ingest.py",
                       ("x_split_passages*", "x__split*", "x__fits*", "x__pack*", "x__fill*", "x__last_fitting*"),
                       ("tests/test_retrieval_ingest.py", "tests/test_attack_ingest.py", "-k",
                        "split or short or packed or breaks or whitespace or exceed or too_small or linear or prefix "
                        "or endings")),
}


def prepare(name: str, target: Target) -> Path:
    """A fresh copy of the package, the tests (and the benchmarks some of them import) and pyproject.toml with this
    module's mutmut table."""
    folder = WORK / name
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for part in ("ctx_integrations", "tests", "benchmarks"):
        shutil.copytree(ROOT / part, folder / part, ignore=ignore)
    table = {"source_paths": ["ctx_integrations/"], "only_mutate": [target.path],
             "pytest_add_cli_args_test_selection": list(target.tests),
             "pytest_add_cli_args": ["-p", "no:cacheprovider", "-q"], "also_copy": ["benchmarks/"]}
    lines = ["", "[tool.mutmut]"] + [f"{key} = {json.dumps(value)}" for key, value in table.items()]
    (folder / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text() + "\n".join(lines) + "\n")
    (folder / target.path).write_text(undecorated((ROOT / target.path).read_text()))
    return folder


# Lone decorators mutmut would make it skip a function, re-applied by assignment after the definitions instead
REAPPLIED = ("torch.inference_mode()", "property", "functools.cache")


def undecorated(source: str) -> str:
    """The module with each function's or method's lone decorator of :data:`REAPPLIED` applied after the definitions.

    mutmut leaves every decorated function alone (it cannot know what a decorator does with the copies it
    makes), so the row pool's ``merge``, ``keep_rows``, ``rewind``, ``forward`` and every property had no
    mutant. The same decorator applied by assignment at the end of the module
    (``RowPool.merge = torch.inference_mode()(RowPool.merge)``) wraps mutmut's trampoline instead: the code
    under test behaves as before. A property with a setter keeps its decorators (the setter needs the property).
    """
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    dropped, wrapped = set(), []
    scopes = [(node, f"{node.name}.") for node in tree.body if isinstance(node, ast.ClassDef)]
    for scope, prefix in [(tree, ""), *scopes]:
        decorators = [ast.unparse(d) for node in scope.body if isinstance(node, ast.FunctionDef)
                      for d in node.decorator_list]
        for node in scope.body:
            if not isinstance(node, ast.FunctionDef) or len(node.decorator_list) != 1:
                continue
            decorator = node.decorator_list[0]
            name = ast.unparse(decorator)
            if name not in REAPPLIED or any(d.startswith(f"{node.name}.") for d in decorators):
                continue
            if decorator.lineno != decorator.end_lineno:
                raise SystemExit(f"a decorator over several lines above {node.name}: move it by hand")
            dropped.add(decorator.lineno - 1)
            wrapped.append(f"{prefix}{node.name} = {name}({prefix}{node.name})\n")
    if not wrapped:
        return source
    kept = [line for number, line in enumerate(lines) if number not in dropped]
    note = "\n\n# tools/mutate.py: decorators re-applied here, so that mutmut mutates what they decorate\n"
    return "".join(kept) + note + "".join(wrapped)


def previous_results(name: str, target: Target, earlier: Path) -> dict[str, int]:
    """Exit codes of an earlier run of ``name`` in ``earlier`` (a MUTATE_WORK folder), if its module is unchanged.

    Tests are only ever added, so a mutant an earlier run killed stays killed while the module is
    byte-identical; only its survivors need running again.
    """
    old = earlier / name
    if (old / target.path).read_text() != undecorated((ROOT / target.path).read_text()):
        raise SystemExit(f"{target.path} changed since the run in {old}: run every mutant again")
    return json.loads((old / "mutants" / (target.path + ".meta")).read_text())["exit_code_by_key"]


def run(name: str, target: Target, children: int) -> dict[str, int]:
    module = target.path.removesuffix(".py").replace("/", ".")
    earlier = os.environ.get("MUTATE_SURVIVORS_OF")
    before = previous_results(name, target, Path(earlier)) if earlier else {}
    folder = prepare(name, target)
    if before:
        patterns = [key for key, code in before.items() if code == 0
                    and any(_matches(key, module, f) for f in target.functions)]
    else:
        patterns = [f"{module}.{f}" for f in target.functions]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")
    if patterns:
        subprocess.run([str(MUTMUT), "run", "--max-children", str(children), *patterns], cwd=folder, env=env,
                       stdout=subprocess.DEVNULL, check=False)
    results = json.loads((folder / "mutants" / (target.path + ".meta")).read_text())["exit_code_by_key"]
    if before:  # the earlier run's codes, with its survivors' new ones
        results = {**before, **{key: results[key] for key in patterns}}
    chosen = {key: code for key, code in results.items() if any(_matches(key, module, f) for f in target.functions)}
    counts = {"killed": 0, "timeout": 0, "survived": 0, "other": 0}
    survivors = []
    for key, code in sorted(chosen.items()):
        # -24 (SIGXCPU): mutmut stopped a mutant past its time limit (a mutant that loops): detected, not killed
        status = "killed" if code in (1, 3) else "timeout" if code == -24 else "survived" if code == 0 else "other"
        counts[status] += 1
        if status in ("survived", "other"):
            survivors.append((key, code))
    print(f"== {name}: {counts['killed']} killed, {counts['timeout']} timed out, {counts['survived']} survived, "
          f"{counts['other']} other (of {len(chosen)})", flush=True)
    for key, code in survivors:
        diff = subprocess.run([str(MUTMUT), "show", key], cwd=folder, env=env, capture_output=True, text=True).stdout
        print(f"-- {key} (exit code {code})")
        print("\n".join(line for line in diff.splitlines() if line.startswith(("-", "+"))
                        and not line.startswith(("---", "+++"))))
    return counts


def _matches(key: str, module: str, pattern: str) -> bool:
    from fnmatch import fnmatch

    return fnmatch(key, f"{module}.{pattern}")


def main(argv: list[str]) -> int:
    names = argv or list(TARGETS)
    unknown = [n for n in names if n not in TARGETS]
    if unknown:
        print(f"unknown module(s) {unknown}; choose from {', '.join(TARGETS)}", file=sys.stderr)
        return 2
    children = int(os.environ.get("MUTATE_CHILDREN", "2"))
    for name in names:
        run(name, TARGETS[name], children)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
