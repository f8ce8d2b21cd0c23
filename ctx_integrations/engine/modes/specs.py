"""The built-in modes' declarations: every option's type, default, range or choices, help and origin, and the paper.

This module imports no torch, so the command line, the server and the adapters check a mode and its options
before a model loads (:func:`~ctx_integrations.engine.core.mode_catalog.check_mode`). Each declaration is named by
an entry point of the ``ctx_integrations.modes`` group in pyproject.toml, as a third-party package names its own;
a test fails when a ModeSpec here has no entry point. Each mode's module
registers its function under its declaration (``@register_mode(PCED)``), and the registry refuses a function
whose keyword options or defaults differ from it. The numbers the modes' own checks share (ranges, defaults)
are defined here once and imported by the modes. docs/modes.md is this module as a table
(``python tools/modes_doc.py``; a test fails when the two differ).
"""

from __future__ import annotations

from ctx_integrations.engine.core.config import ATTENTION_KERNELS
from ctx_integrations.engine.core.mode_spec import ModeSpec, Option

_MODES = "ctx_integrations.engine.modes."

# -- retrieval priors (engine/modes/priors.py), shared by PCED, APE and Soft-NBCE ------------------------------
PRIORS = ("paper", "softmax", "rank", "minmax")
# The default of every mode that takes a prior, measured on NQ-open with real retrieval:
# docs/evaluation.md#nq-open-with-real-retrieval-what-the-prior-needs
DEFAULT_PRIOR = "softmax"
DEFAULT_TAU = 0.05  # softmax's temperature, in units of r
DEFAULT_FLOOR = 0.05  # minmax's prior of the lowest-scored document (log 0.05 = -3.0 nats before gamma)
MIN_PRIOR_TAU, MAX_PRIOR_TAU = 1e-4, 100.0
# Largest weight of the question's likelihood: at 100 one nat counts as 100 x tau of score, far past the measured 0.2
# (a few nats' difference then outweighs any gap of the default prior), and larger weights only cost float32 precision
# (a question's log-likelihood reaches -100s of nats).
MAX_QUERY_LIKELIHOOD = 100.0


def _prior_options(what: str) -> tuple[Option, ...]:
    """``prior``, ``prior_tau``, ``prior_floor``: how a mode turns the documents' scores into its log-prior."""
    return (
        Option("prior", str, DEFAULT_PRIOR, f"how the scores become {what}'s log-prior: 'paper' (log r) or our "
               "per-query calibrations 'softmax', 'rank', 'minmax'", origin="variant", choices=PRIORS),
        Option("prior_tau", float, DEFAULT_TAU, "the softmax prior's temperature, in units of r", origin="variant",
               minimum=MIN_PRIOR_TAU, maximum=MAX_PRIOR_TAU),
        Option("prior_floor", float, DEFAULT_FLOOR, "the minmax prior's value for the lowest-scored document",
               origin="variant", minimum=0.0, maximum=1.0, min_inclusive=False),
    )


# -- PCED (engine/modes/pced.py) ------------------------------------------------------------------------------------
SCORE_SPACES = ("logprobs", "logits")
AGGREGATIONS = ("max", "mixture", "product")
SWITCHES = ("token", "word")
# Largest beta and gamma: past them float32 loses the scores (gamma * log r reaches -8.7e3 x gamma for r near 0,
# and a common offset of 1e8 rounds every token's score to the same value, so argmax returns token 0), and at
# ~1e36 they overflow to inf and NaN. The paper's values are beta in [0, ln 2] (dynamic) and gamma = 2.5.
PCED_MAX_BETA = PCED_MAX_GAMMA = 100.0
# The paper's weight of the retrieval prior (appendix B), for its prior, log r.
PAPER_GAMMA = 2.5
# The default weight, for the default calibrated prior (softmax(r / 0.05) over the retrieved set; our variant),
# measured on NQ-open with real retrieval (200 questions, docs/evaluation.md): EM 0.615 against 0.600 with the
# paper's 2.5 (+3 / -0 questions) and `single`'s 0.610. The paper's rule: prior="paper", gamma=PAPER_GAMMA.
PCED_GAMMA = 5.0

PCED = ModeSpec(
    "pced", "an amateur stream and one expert stream per cached document, fused per token with the retrieval prior",
    "Parallel Context-of-Experts Decoding for Retrieval Augmented Generation (anonymous, ACL submission)",
    (
        Option("beta", float, None, "contrast with the amateur stream; None: dynamic, each expert's JSD at the first "
               "token (AdaCAD's rule)", optional=True, minimum=0.0, maximum=PCED_MAX_BETA),
        Option("gamma", float, PCED_GAMMA, "weight of the retrieval prior gamma * log-prior (the paper's 2.5 goes with "
               "prior='paper'; 0: no prior)", minimum=0.0, maximum=PCED_MAX_GAMMA),
        Option("score_space", str, "logprobs", "'logprobs' (experts comparable) or 'logits' (the paper's literal "
               "rule)", origin="variant", choices=SCORE_SPACES),
        Option("aggregation", str, "max", "'max' (token-level expert switching), 'mixture' or 'product' (the "
               "paper's ablation)", choices=AGGREGATIONS),
        Option("switch", str, "token", "'token' (the paper's rule) or 'word' (the expert that began a word finishes "
               "it; needs aggregation='max')", origin="variant", choices=SWITCHES),
        *_prior_options("PCED"),
        Option("query_likelihood", float, 0.0, "weight of log p(question | document) in the softmax prior (0: off)",
               origin="variant", minimum=0.0, maximum=MAX_QUERY_LIKELIHOOD),
    ),
    module=_MODES + "pced",
)

# -- APE (engine/modes/ape.py) ---------------------------------------------------------------------------------------
# APE's defaults, measured on NQ-open with real retrieval (200 questions, docs/evaluation.md): the retrieval prior's
# weight (our variant; 0 = the paper's APE: each document's attention scaled by its softmax prior over the retrieved
# set, softmax(r / 0.05), relative to the top document's, to the power gamma) and the paper's two per-task knobs at
# 1.0, T = S = 1 (the authors' code has 0.9 / 0.9). Together: EM 0.615 against 0.565 with gamma 1 at 0.9 / 0.9;
# neither change alone gets there (gamma 3 at 0.9 / 0.9: 0.570; gamma 1 at 1.0 / 1.0: 0.575).
APE_GAMMA = 3.0
APE_MAX_GAMMA = 100.0
ATTENTION_TEMPERATURE = 1.0
SCALE = 1.0
# Smallest attention_temperature: the document scores are divided by it, and below ~1e-37 they overflow float32
# (every token then gets NaN and greedy decoding emits token id 0); below 0.01 the attention is already a hard
# argmax. The paper's grid is 0.1-1.0.
MIN_ATTENTION_TEMPERATURE = 0.01

APE = ModeSpec(
    "ape", "the cached documents at shared positions in one sequence, the question's attention over them tempered "
    "and scaled", "APE: Faster and Longer Context-Augmented Generation via Adaptive Parallel Encoding (Yang, Chen, "
    "Chen; ICLR 2025, arXiv:2502.05431)",
    (
        Option("attention_temperature", float, ATTENTION_TEMPERATURE, "T, divides the question's attention scores "
               "over the documents (sharper below 1)", minimum=MIN_ATTENTION_TEMPERATURE, maximum=1.0),
        Option("scale", float, SCALE, "S, scales the documents' log-sum-exp in the merge (less weight on them below "
               "1)", minimum=0.0, maximum=1.0, min_inclusive=False),
        Option("attention_kernel", str, "auto", "'auto' or 'eager': APE's row of the shared batch; 'flex': "
               "FlexAttention's merge, a job of its own (no citations)", origin="implementation",
               choices=ATTENTION_KERNELS),
        Option("attribution", bool, None, "record each token's attention mass per document and cite the largest; "
               "None: wherever the kernel can", origin="implementation", optional=True),
        Option("gamma", float, APE_GAMMA, "weight of the retrieval prior on each document's attention (0: the "
               "paper's APE, no scores)", origin="variant", minimum=0.0, maximum=APE_MAX_GAMMA),
        *_prior_options("APE"),
    ),
    module=_MODES + "ape",
)

# -- RAPID (engine/modes/rapid.py, speculative.py) -------------------------------------------------------------------
RANKINGS = ("dense", "bm25", "scores", "auto")
TAIL_RULES = ("paper", "draft_head")
# Largest eta: eta (q - p) overflows float32 near 1e38, and p^ = softmax(z / T + eta (q - p)) becomes NaN (greedy
# decoding then emits token id 0); the paper uses 5-50.
MAX_ETA = 1000.0

RAPID = ModeSpec(
    "rapid", "a drafter over a short retrieved context proposes tokens, the target over the whole context "
    "verifies them", "RAPID: Long-Context Inference with Retrieval-Augmented Speculative Decoding (Chen, Feng, Ni, "
    "Li, Shieh; ICML 2025, arXiv:2502.20330)",
    (
        Option("gamma", int, 10, "tokens drafted per round", minimum=1),
        Option("eta", float, 10.0, "how strongly the drafter's distribution shifts the target's (0: plain "
               "speculative decoding)", minimum=0.0, maximum=MAX_ETA),
        Option("drafter", object, None, "the drafter engine, with the target's tokenizer (None: the target model)",
               optional=True, expects="an Engine, or None (draft with the target model)"),
        Option("draft_context_tokens", int, None, "the drafter's context budget in tokens (None: the paper's bounds, "
               "4096 tokens to 1/24 of the input)", optional=True, minimum=1),
        Option("chunk_tokens", int, 512, "tokens per chunk of the drafter's retrieval", minimum=1),
        Option("min_similarity", float, 0.3, "chunks scoring below it are dropped from the drafter's context",
               minimum=-1.0, maximum=1.0),
        Option("ranking", str, "dense", "how chunks are ranked: 'dense' (the paper's), 'bm25', the documents' "
               "'scores', or 'auto'", origin="variant", choices=RANKINGS),
        Option("draft_embedder", object, None, "the dense ranking's embedder (None: the embedded MiniLM)",
               optional=True, expects="an object with embed_documents(texts) and embed_query(text), or None"),
        Option("tail_rule", str, "paper", "'paper' (Eq. 9 on p^) or 'draft_head' (our earlier variant: the shift "
               "only where q >= 0.1 max q)", origin="variant", choices=TAIL_RULES),
        Option("compare_target", bool, False, "then decode as many tokens with the target alone and report the "
               "measured speedup", origin="implementation"),
    ),
    module=_MODES + "rapid", picks_each_token=False,
)

# -- IPPD (engine/modes/ippd.py) -------------------------------------------------------------------------------------
IPPD = ModeSpec(
    "ippd", "many questions over shared documents answered in one stacked decode (generate_many)",
    "Intra-Prompt Parallel Decoding for Common-Context Question Answering (anonymous, under review)",
    (Option("max_stack_tokens", int, None, "the most tokens one stacked prompt may hold (None: the model's "
            "window); more questions go into further stacks", origin="implementation", optional=True, minimum=1),),
    module=_MODES + "ippd", many=True,
)

# -- Soft-NBCE and its limits (engine/modes/soft_nbce.py) ----------------------------------------------------------
SOFT_NBCE_PAPER = "Soft-NBCE: Entropy-Weighted Chunk Fusion for Long-Context Decoding (Ji, Li, Song; preprint, 2026)"
RULES = ("paper", "nbce_code")
DEFAULT_CHUNK_TOKENS = 2048
# Knob ranges that keep float32 finite: beta scales log-probs ((1 + beta) L - beta L_prior overflows to inf - inf
# = NaN near 1e36, and past ~1e8 rounds every token to one score, so greedy emits token id 0), and the entropy
# weights divide by tau (all -inf, then NaN, below ~1e-37; at 1e-9 they are already hard NBCE's one-hot).
SOFT_NBCE_MAX_BETA = 100.0
MIN_TAU = 1e-9
# The mode's defaults where the retriever ranks the chunks (our variant, measured on NQ-open with real retrieval,
# 200 questions, docs/evaluation.md): the chunks' weights also follow a retrieval prior of weight SOFT_NBCE_GAMMA (a
# softmax over the retrieved set), and every token stays in the support (rho = 1). Where nothing ranks them (no
# scores, equal scores, one document cut into chunks) the rule is the paper's: gamma 0, each chunk's top PAPER_RHO.
SOFT_NBCE_GAMMA = 10.0
PAPER_RHO = 0.9


def _chunk_options(beta: float, rho: Option) -> tuple[Option, ...]:
    """``beta``, ``rho``, ``chunk_tokens``, ``rule``: the chunk fusion's knobs, shared by soft_nbce, nbce and pcw."""
    return (
        Option("beta", float, beta, "contrast with the question-only prior, (1 + beta) L_chunk - beta L_prior (0: "
               "none)", minimum=0.0, maximum=SOFT_NBCE_MAX_BETA),
        rho,
        Option("chunk_tokens", int, DEFAULT_CHUNK_TOKENS, "split documents into chunks of at most this many tokens "
               "(None: one stream per document)", optional=True, minimum=1),
        Option("rule", str, "paper", "'paper' (Algorithm 1) or 'nbce_code' (NBCE's reference code: log-probs "
               "clipped at -100)", origin="variant", choices=RULES),
    )


def _rho(optional: bool) -> Option:
    """``rho``: soft_nbce's defaults to None (chosen by whether the prior ranks the chunks), nbce's and pcw's to 0.9."""
    default = None if optional else PAPER_RHO
    line = ("each chunk's top-p before fusion (None: 0.9 when nothing ranks the chunks, 1.0 when the prior does)"
            if optional else "each chunk's top-p before fusion")
    return Option("rho", float, default, line, optional=optional, minimum=0.0, maximum=1.0, min_inclusive=False)


SOFT_NBCE = ModeSpec(
    "soft_nbce", "chunk experts weighted per token by softmax(-entropy / tau), contrasted with a question-only "
    "prior", SOFT_NBCE_PAPER,
    (
        Option("tau", float, 0.1, "temperature of the entropy weights (-> 0: hard NBCE; inf: uniform average, "
               "PCW)", minimum=MIN_TAU, allow_inf=True),
        *_chunk_options(0.25, _rho(optional=True)),
        Option("gamma", float, SOFT_NBCE_GAMMA, "weight of the retrieval prior in the chunk weights (0: the paper's, "
               "entropy alone)", origin="variant", minimum=0.0, maximum=SOFT_NBCE_MAX_BETA),
        *_prior_options("Soft-NBCE"),
        Option("query_likelihood", float, None, "weight of log p(question | chunk) in the softmax prior (None: 0.2 "
               "where the scores rank the chunks, else off; 0: off)", origin="variant", optional=True, minimum=0.0,
               maximum=MAX_QUERY_LIKELIHOOD),
    ),
    module=_MODES + "soft_nbce",
)
NBCE = ModeSpec("nbce", "hard NBCE, Soft-NBCE's tau -> 0 limit: each token from the lowest-entropy chunk",
                SOFT_NBCE_PAPER + ": its Vanilla NBCE baseline", _chunk_options(0.25, _rho(optional=False)),
                module=_MODES + "soft_nbce")
PCW = ModeSpec("pcw", "the uniform chunk average, Soft-NBCE's tau -> inf limit with beta 0",
               SOFT_NBCE_PAPER + ": its PCW baseline", _chunk_options(0.0, _rho(optional=False)),
               module=_MODES + "soft_nbce")

# -- baselines (engine/modes/baselines.py) ---------------------------------------------------------------------------
_PCED_BASELINE = "baseline of the PCED paper"
CONCAT = ModeSpec("concat", "every document in one prompt, prefilled sequentially (no cache reuse)",
                  _PCED_BASELINE + " ('All')", module=_MODES + "baselines")
SINGLE = ModeSpec("single", "only the top-1 document by score, decoded from its cached KV",
                  _PCED_BASELINE + " ('Single')", module=_MODES + "baselines")
TRUNCATED = ModeSpec(
    "truncated", "the concatenated documents cut to their last tokens that fit the window",
    "baseline of the Soft-NBCE paper",
    (Option("context_tokens", int, None, "keep the last this many context tokens (None: as many as fit the window)",
            optional=True, minimum=1),),
    module=_MODES + "baselines",
)
MAP_REDUCE = ModeSpec(
    "map_reduce", "each document summarised from its cache, then the answer from the summaries",
    _PCED_BASELINE + " ('MapReduce')",
    (Option("summary_tokens", int, 96, "the most tokens of each summary", minimum=1),),
    module=_MODES + "baselines",
    exemptions=(("reuses_prepared_texts", "its summaries are new text on every request, tokenised for the reduce "
                 "step"),),
)
