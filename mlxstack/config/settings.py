"""One place for every setting: a frozen dataclass loaded from the environment.

Usage:
    from mlxstack.config.settings import load_settings
    settings = load_settings()            # reads .env (python-dotenv) + os.environ
    settings = load_settings(env={...})   # tests: an explicit mapping, no files

Every variable is declared once in ``SPECS`` (name, type, default, description).
``.env.example`` documents all of them; ``tests/test_settings.py`` proves the two agree.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, NamedTuple

REPO_ROOT = Path(__file__).resolve().parents[2]


class SettingsError(ValueError):
    """A user-facing configuration error; the message names the variable and how to fix it."""


class Spec(NamedTuple):
    name: str
    kind: str  # "str" | "int" | "float" | "bool" | "choice"
    default: Any
    doc: str
    minimum: float | None = None
    choices: tuple[str, ...] = ()
    group: str = "general"


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}

SPECS: tuple[Spec, ...] = (
    # --- model -----------------------------------------------------------------
    Spec("MODEL_PATH", "str", "", "Local model folder or Hugging Face repo id. Empty = embedded SmolLM2-135M-Instruct.", group="model"),
    Spec("MODEL_FETCH", "bool", True, "A MODEL_PATH / DRAFT_MODEL that names a Hugging Face repo id (owner/name) not in the local hub cache is downloaded at load: only the files MLX loads (safetensors, JSON configs, tokenizer, chat templates; never .bin / .gguf / .onnx), resumed after a broken connection, refused at once when the free disk is short of its size; progress on the console and in /health (fetch). Endpoint HF_ENDPOINT, cache HF_HUB_CACHE / HF_HOME, token HF_TOKEN (huggingface_hub's own variables). false: a model not cached is an error ('mlxstack pull REPO' downloads ahead).", group="model"),
    Spec("MODELS_DIR", "str", "", "A folder of local MLX model folders (each with a config.json): 'mlxstack models' lists them beside the hub cache's MLX repos, and MODEL_PATH / DRAFT_MODEL may name one by its folder name. Empty = none.", group="model"),
    Spec("MODEL_FAMILY", "choice", "auto", "Output-parsing family; auto detects from the model's config.", choices=("auto", "qwen3", "glm4", "harmony", "generic"), group="model"),
    Spec("MODEL_CACHE_DIR", "str", "", "Where the embedded model is converted to MLX once. Empty = ~/.cache/mlxstack.", group="model"),
    Spec("CPU_FLOAT32", "bool", True, "On CPU-only MLX, dequantize/upcast weights to float32 (BLAS-friendly, much faster prefill).", group="model"),
    Spec("BLAS_PRELOAD", "str", "auto", "Linux: optimised BLAS to LD_PRELOAD into the MLX server (auto | off | /path/libopenblas.so).", group="model"),
    Spec("MODELS_ON_DEMAND", "bool", False, "The MLX port serves every installed model (MODELS_DIR, the hub cache's MLX repos, the embedded one; a repo id not cached is fetched when MODEL_FETCH allows): a router (mlxstack/residency) starts one MLX server process per model on the first request naming it (concurrent first requests share one load), keeps several within MODEL_MEMORY_BUDGET, unloads the least recently used idle one to make room, MODEL_IDLE_TTL_SECONDS idle ones, never MODEL_PIN ones; a model that cannot fit alone gets 400 model_too_large. Sessions of an unloaded model stay on the disk tier (DISK_CACHE_DIR). false: one MLX server for MODEL_PATH (or BACKENDS_FILE).", group="model"),
    Spec("MODEL_MEMORY_BUDGET", "int", 0, "MODELS_ON_DEMAND: bytes the resident models may take together, each counted as its weights on disk + its KV budget (PROMPT_CACHE_MAX_BYTES, or when that is 0 a quarter of this budget) + its process (MODEL_PROCESS_BYTES). 0 = auto: 75% of RAM (Linux) or of Metal's recommended working set.", minimum=0, group="model"),
    Spec("MODEL_PROCESS_BYTES", "int", 0, "MODELS_ON_DEMAND: memory each model server takes besides its weights and KV budget (Python, MLX, tokenizer), counted in MODEL_MEMORY_BUDGET. 0 = measured: the resident memory of the first server loaded beyond its weights (until then 0).", minimum=0, group="model"),
    Spec("MODEL_IDLE_TTL_SECONDS", "float", 0.0, "MODELS_ON_DEMAND: a model no request has used for this long is unloaded (its sessions stay on the disk tier). 0 = only when another model needs its room.", minimum=0, group="model"),
    Spec("MODEL_PIN", "str", "", "MODELS_ON_DEMAND: comma-separated model names loaded at start and never unloaded (the main model, MODEL_PATH, is loaded at start too but may be unloaded).", group="model"),
    Spec("HUGE_PAGES", "choice", "auto", "Linux: transparent huge pages for the MLX server's malloc (GLIBC_TUNABLES=glibc.malloc.hugetlb=1; system/hugepages.py): fewer page faults when KV is loaded or copied, fewer TLB misses while the weights stream through a decode step. auto: where the kernel's THP mode is madvise / always and glibc >= 2.35; off: never. A GLIBC_TUNABLES that already names the tunable wins.", choices=("auto", "off"), group="model"),
    Spec("PREFILL_STEP_SIZE", "int", 512, "Tokens per prefill chunk.", minimum=1, group="model"),
    Spec("MAX_KV_SIZE", "int", 0, "Context window in tokens (prompt + reply). 0 = the model's own (max_position_embeddings / max_seq_len / tokenizer model_max_length); a longer prompt gets 400 context_length_exceeded.", minimum=0, group="model"),
    # --- cpu backend -----------------------------------------------------------
    Spec("CPU_BACKEND", "choice", "auto", "The CPU backend (backends/cpu/; docs/cpu-backend.md): what makes a decode step on MLX's CPU backend op-light -- the four settings below, each deciding for itself where it applies. auto: where MLX computes on the CPU (and wherever CPU_KERNELS=on, and on every rank of a DISTRIBUTED model); off: none of it, MLX's own forward and mlx-lm's functions (the cascade attention for shared prefixes stays: every backend has it). What it turned on and why is logged at load and shown in /health (backend).", choices=("auto", "off"), group="cpu backend"),
    Spec("CPU_KERNELS", "choice", "auto", "Attention and SiLU on MLX's CPU backend with an exp that is not a libm call per element (backends/cpu/fast_math.py; within 1.2e-7 of mx.exp). auto: on where MLX computes on the CPU and that exp measures faster at load (x86 wheels); on / off: always / never (off: mlx-lm's own functions, bit for bit).", choices=("auto", "on", "off"), group="cpu backend"),
    Spec("NATIVE_ATTENTION", "choice", "auto", "With CPU_KERNELS on: decode-sized attention (a decode step, a speculative verification) in one native call built with the system C compiler -- ahead by `mlxstack build-native` (install_and_run.py runs it), else at load (backends/cpu/native_attention.py; within float rounding of the MLX path, checked at load; DISTRIBUTED=pipeline keeps the MLX ops); with the host path, TurboQuant's decode-sized coder too (KV_QUANT_SCHEME=turboquant: backends/cpu/turboquant_host.py, numpy where off). auto: where it builds and agrees; off: MLX ops only.", choices=("auto", "off"), group="cpu backend"),
    Spec("HOST_FORWARD", "choice", "auto", "With CPU_KERNELS on: decode-sized forwards (up to 16 positions a row: a decode step, a verification, a turn's closer, a short warm rest) of an mlx-lm Llama-family float32 model computed on numpy views of its weights (products through the preloaded OpenBLAS or NATIVE_PRODUCTS's loop, RoPE / KV writes / attention still through MLX and the cache) instead of ~20 MLX ops per layer (backends/cpu/host_forward.py; within float rounding, checked at load; one process only, not DISTRIBUTED). auto: where the model qualifies and agrees; off: mlx-lm's forward.", choices=("auto", "off"), group="cpu backend"),
    Spec("NATIVE_PRODUCTS", "choice", "auto", "With HOST_FORWARD on: its weight products for up to 128 positions in one native loop built with the system C compiler, ahead or at load as NATIVE_ATTENTION's (backends/cpu/native_products.py: reads each weight row once in place on two threads, where OpenBLAS repacks the weight on every call; ~1.5x faster products at 8 rows here, level at 128; a row's result the same alone or batched; within float rounding of sgemm, checked at load). auto: where it builds, agrees and is faster than sgemm at 1 and 8 rows when timed at load (a loop that is correct but slow here never runs); off: OpenBLAS's sgemm.", choices=("auto", "off"), group="cpu backend"),
    # --- network ---------------------------------------------------------------
    Spec("MLX_HOST", "str", "127.0.0.1", "MLX server bind address.", group="network"),
    Spec("MLX_PORT", "int", 8080, "MLX server port.", minimum=0, group="network"),
    Spec("PROXY_HOST", "str", "127.0.0.1", "LiteLLM proxy bind address (0.0.0.0 exposes it to your network).", group="network"),
    Spec("PROXY_PORT", "int", 4000, "LiteLLM proxy port.", minimum=0, group="network"),
    Spec("PROXY_MODEL_ID", "str", "", "Model name exposed through LiteLLM. Empty = openai/<model name>; the bare name is listed too.", group="network"),
    Spec("MODEL_ALIASES", "str", "claude-*opus*=main,claude-*sonnet*=main,claude-*haiku*=main,gpt-*=main", "More model names clients may ask port 4000 for, comma-separated pattern=target ('*' any run of characters): target main is the stack's model (MODEL_PATH; with a backends file the first model), or any model name LiteLLM lists (a backends-file name or alias, e.g. claude-*haiku*=small-fast). The defaults let Claude Code and OpenAI clients run unconfigured (ANTHROPIC_MODEL unset). LiteLLM lists the patterns in /v1/models?return_wildcard_routes=true (plain /v1/models: the real names); the MLX server's Anthropic Messages endpoint (LiteLLM's pass-through) accepts the main ones too. off or empty = none.", group="network"),
    Spec("LITELLM_MASTER_KEY", "str", "", "Key clients send as 'Authorization: Bearer …'. install_and_run.py generates one on first run.", group="network"),
    Spec("TENANT_KEYS_FILE", "str", "", "JSON file of tenants' keys for port 4000 ({\"alice\": \"sk-…\"}, mode 0600; 'mlxstack tenant add NAME' writes it): each tenant's cache, sessions, healing and diagnoses are its own, never seen, reused or timed by another; the master key is the default tenant. Empty: one tenant.", group="network"),
    Spec("MLX_STARTUP_TIMEOUT_SECONDS", "float", 900.0, "How long start_llm.py waits for the MLX server to load/prepare the model (first run converts it).", minimum=1, group="network"),
    Spec("PROXY_STARTUP_TIMEOUT_SECONDS", "float", 120.0, "How long to wait for LiteLLM to report ready.", minimum=1, group="network"),
    Spec("PROXY_STARTUP_WAIT_SECONDS", "str", "", "The seed's name for PROXY_STARTUP_TIMEOUT_SECONDS (seconds, >= 1), read so a seed .env keeps working: set alone it is the limit; set together with PROXY_STARTUP_TIMEOUT_SECONDS to another value it is a start-up error. Empty = not set.", group="network"),
    Spec("PROXY_REQUEST_TIMEOUT_SECONDS", "float", 3600.0, "LiteLLM timeout / stream_timeout towards the MLX server (long prefills).", minimum=1, group="network"),
    Spec("MAX_CONCURRENT_SEQUENCES", "int", 0, "Requests in flight at once (continuous batching: decode steps batched into one forward pass, prefill chunks interleaved). 0 = auto (8); 1 = one request at a time, FIFO.", minimum=0, group="network"),
    Spec("PRIORITY_SCHEDULING", "bool", True, "Requests go by priority (vLLM's integer, lower first: the request's 'priority' field or the x-mlxstack-priority header; else derived from the agent client's request: its own turn 0, a sub-agent's 1, a background call's 2 -- prompt/urgency.py): the most urgent waiting request takes the next row and its prompt the next prefill chunk, and while one is in flight the less urgent decode rows beyond PRIORITY_DECODE_ROWS leave the batch with their KV and resume exactly where they were once it is done; when the RAM cache must give up entries (its count or byte limit), a less urgent request's go first (the user's session outlives its sub-agents'). Off: first come, first served, entries by their score alone. One priority everywhere is first come, first served too.", group="network"),
    Spec("PRIORITY_DECODE_ROWS", "int", 0, "Less urgent decode rows that go on decoding beside a more urgent request (the rest are preempted until it is done). 0 = the urgent request decodes alone, at its speed alone (benchmarks/bench_priority.py); more rows keep the background going during it, each of its decode steps then costs more.", minimum=0, group="network"),
    Spec("PRIORITY_DECODE_SHARE", "float", 0.9, "More less urgent rows go on decoding beside a more urgent request than PRIORITY_DECODE_ROWS while decode steps of that many rows were measured here (the fastest of at least 8 timed) to keep its tokens at this share of their speed alone or better (on a GPU or Apple Silicon a batch costs little more than one row: the background keeps decoding; on a CPU it does not: it pauses). 0 = PRIORITY_DECODE_ROWS only.", minimum=0, group="network"),
    Spec("PRIORITY_AGING_SECONDS", "float", 30.0, "Waiting raises a request's (and a preempted row's) urgency by one priority level per this many seconds, so nothing waits forever behind more urgent traffic. 0 = no aging.", minimum=0, group="network"),
    Spec("ARRIVAL_WINDOW_MS", "int", 30, "After an idle spell, a request that arrives while the last decode batch held several rows waits up to this long for as many requests as that batch held (agents that fan out and come back together), so their prompts prefill in one batched forward instead of two; a lone client never waits. 0 = start at once.", minimum=0, group="network"),
    Spec("SHARED_PREFIX_MIN_TOKENS", "int", 256, "Requests in flight that share at least this many prompt tokens hold them once: requests arriving together prefill them once, rows of the decode batch keep only their own tails and attend the shared prefix by cascade attention (checked per model at load). 0 = off (every request in flight holds its own copy; cache entries still store a hit's reused prefix by reference).", minimum=0, group="network"),
    Spec("PREFILL_CHUNK_TOKENS", "int", 512, "Prefill tokens one sequence gets per scheduler step while others decode (bounds how long a long prompt holds the other streams).", minimum=16, group="network"),
    Spec("MAX_QUEUED_REQUESTS", "int", 16, "Requests waiting for the inference worker; beyond it → 503 + Retry-After.", minimum=1, group="network"),
    Spec("MAX_REQUEST_BYTES", "int", 64 * 1024 * 1024, "Largest accepted request body (413 above).", minimum=1024, group="network"),
    Spec("RESPONSE_STORE_MAX_ENTRIES", "int", 256, "Responses API: conversations kept in memory for previous_response_id (least recently used go first).", minimum=1, group="network"),
    Spec("RESPONSE_STORE_MAX_BYTES", "int", 256 * 1024 * 1024, "Responses API: byte cap of those conversations (their JSON size, images included); a single conversation over it is not kept (a later previous_response_id to it gets 400 previous_response_not_found).", minimum=1024, group="network"),
    Spec("MLX_API_KEY", "str", "", "Key the MLX server requires as 'Authorization: Bearer …' on every route but /health (LiteLLM sends it). install_and_run.py generates one; required when MLX_HOST is not loopback.", group="network"),
    Spec("MLX_ALLOWED_HOSTS", "str", "", "Extra Host-header names the MLX server answers, comma-separated (IP literals, localhost and MLX_HOST always pass): the DNS-rebinding guard.", group="network"),
    Spec("MLX_ALLOWED_ORIGINS", "str", "", "Browser origins allowed to call the MLX server, comma-separated (e.g. http://localhost:3000); a request from any other Origin gets 403.", group="network"),
    Spec("MLX_HTTP_THREADS", "int", 64, "MLX server handler threads; further connections wait up to 2 s for one, then get 503 + Retry-After.", minimum=2, group="network"),
    Spec("MLX_HEADER_TIMEOUT_SECONDS", "float", 10.0, "A client must send its request line and headers within this (slow-header clients are dropped).", minimum=0.1, group="network"),
    Spec("MLX_BODY_TIMEOUT_SECONDS", "float", 120.0, "Deadline for receiving a request body, and for each write to a client that stopped reading.", minimum=0.1, group="network"),
    Spec("MLX_MAX_RESTARTS", "int", 5, "The launcher restarts a crashed MLX server at most this often within MLX_RESTART_WINDOW_SECONDS, then stops the stack (0 = never restart).", minimum=0, group="network"),
    Spec("MLX_RESTART_WINDOW_SECONDS", "float", 600.0, "Crash-loop window for MLX_MAX_RESTARTS.", minimum=1, group="network"),
    Spec("INFERENCE_STALL_SECONDS", "float", 600.0, "The MLX server's /health answers 503 (status error, with the reason) when its inference thread made no progress -- no scheduler step, prefill chunk or token -- for this long while requests wait or run; a dead inference thread is reported at once. Generous: one step is one prefill chunk or one decode token (0 = report only a dead thread).", minimum=0, group="network"),
    Spec("MLX_UNHEALTHY_RESTART_SECONDS", "float", 30.0, "The launcher stops and restarts (with the crash backoff and MLX_MAX_RESTARTS) a ready MLX server whose /health reports an error -- inference thread dead or stalled -- for this long (0 = never; a server that does not answer /health is not counted).", minimum=0, group="network"),
    # --- distributed (one model across several processes / machines) -------------
    Spec("DISTRIBUTED", "choice", "off", "Serve one model from several ranks with MLX's own distributed engine (mlx.core.distributed): tensor = every layer's heads split over the ranks (mlx-lm's model.shard; needs a fast link), pipeline = the layers split over the ranks (model.model.pipeline; saves memory per machine). Rank 0 answers HTTP and runs the scheduler, the cache index and the sessions; every step is broadcast so all ranks run the same forwards. off = one process.", choices=("off", "tensor", "pipeline"), group="distributed"),
    Spec("DISTRIBUTED_LOCAL_RANKS", "int", 0, "With DISTRIBUTED on: run this many ranks on this machine (ring backend over 127.0.0.1; tests, large NUMA boxes). 0 = use DISTRIBUTED_HOSTS.", minimum=0, group="distributed"),
    Spec("DISTRIBUTED_HOSTS", "str", "", "With DISTRIBUTED on and no local ranks: a hostfile in mlx.launch's JSON format (one entry per rank: ssh host and IPs; rank 0 is this machine) -- the ranks are started with mlx.launch. Relative paths are under the repo.", group="distributed"),
    Spec("DISTRIBUTED_BACKEND", "choice", "any", "Transport between ranks: ring (TCP, any machines), jaccl (RDMA over Thunderbolt 5 Macs), any (what mlx picks: jaccl where configured, else ring). Local ranks always use ring.", choices=("any", "ring", "jaccl"), group="distributed"),
    # --- backends (several MLX servers behind LiteLLM) --------------------------
    Spec("BACKENDS_FILE", "str", "backends.yaml", "YAML file listing the MLX backends behind LiteLLM: local ones start_llm.py starts (model_path, port, replicas, per-backend env) and remote ones (url, api_key); backends.example.yaml shows the format. Not there = one backend from MODEL_PATH / MLX_PORT (times MLX_REPLICAS). Relative paths are under the repo.", group="backends"),
    Spec("MLX_REPLICAS", "int", 1, "Without a backends file: local replicas of MODEL_PATH on ports MLX_PORT, MLX_PORT+1, … (each its own MLX server process; sessions stay on their replica).", minimum=1, group="backends"),
    Spec("ROUTING", "choice", "cache_aware", "How LiteLLM places requests when a model has several backends. cache_aware: a session stays on its backend (moved, one cold turn, only when it is down); a new session goes to the backend already holding its longest message prefix, else the least loaded. affinity: LiteLLM's own session_affinity on the same session id, least-busy for new ones (requests pinned to a backend that is down or restarting fail). shuffle: no affinity (for comparison).", choices=("cache_aware", "affinity", "shuffle"), group="backends"),
    Spec("ROUTING_AFFINITY_TTL_SECONDS", "float", 3600.0, "How long a session stays pinned to its backend after its last request.", minimum=1, group="backends"),
    # --- sampling defaults -----------------------------------------------------
    Spec("DEFAULT_TEMPERATURE", "float", 0.1, "Sampling temperature when the request has none.", minimum=0, group="sampling"),
    Spec("DEFAULT_TOP_P", "float", 0.9, "Nucleus sampling.", minimum=0, group="sampling"),
    Spec("DEFAULT_TOP_K", "int", 40, "Top-k sampling (0 = off).", minimum=0, group="sampling"),
    Spec("DEFAULT_MIN_P", "float", 0.05, "Minimum-probability threshold.", minimum=0, group="sampling"),
    Spec("DEFAULT_REPETITION_PENALTY", "float", 1.08, "Repetition penalty (1.0 = off) for requests that name none and are not greedy: temperature 0 is the argmax with only the penalties the request names.", minimum=0, group="sampling"),
    Spec("DEFAULT_REPETITION_CONTEXT_SIZE", "int", 256, "Tokens the repetition penalty looks back over.", minimum=1, group="sampling"),
    Spec("REPETITION_PENALTY_SCOPE", "choice", "reply", "Tokens a repetition penalty looks at. reply: the reply's own (breaks its loops, never steers the model off text it should copy from the prompt); all: prompt and reply, as mlx-lm does.", choices=("reply", "all"), group="sampling"),
    Spec("GENERATION_CONFIG", "choice", "auto", "auto: a request's missing sampling fields come from the model's generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty) before the DEFAULT_* settings; off: the settings alone.", choices=("auto", "off"), group="sampling"),
    Spec("DEFAULT_MAX_TOKENS", "int", 2048, "Max output tokens when the request has none.", minimum=1, group="sampling"),
    Spec("DEFAULT_THINKING", "bool", True, "Enable reasoning by default (templates that support enable_thinking).", group="sampling"),
    Spec("PRESERVE_THINKING", "bool", True, "Pass preserve_thinking=True to the chat template when it accepts it.", group="sampling"),
    Spec("GENERATION_WATCHDOG_SECONDS", "float", 600.0, "Wall-clock limit per generation (0 = off); ends with finish_reason=length.", minimum=0, group="sampling"),
    # --- cache -----------------------------------------------------------------
    Spec("PROMPT_CACHE_MAX_ENTRIES_GLOBAL", "int", 24, "Max KV entries in the global cache. 0 disables caching entirely (every request cold).", minimum=0, group="cache"),
    Spec("PROMPT_CACHE_MAX_BYTES", "int", 0, "KV byte budget: the RAM cache tier, and admission -- a request waits (no row) while the KV of the requests in flight plus what it will add would pass it (alone, a request always runs). 0 = auto: 40% of RAM (Linux) or of Metal's recommended working set.", minimum=0, group="cache"),
    Spec("PROMPT_CACHE_MAX_ENTRIES_PER_SESSION", "int", 2, "Cache keys remembered per session (session index).", minimum=1, group="cache"),
    Spec("PROMPT_CACHE_TTL_SECONDS", "float", 1800.0, "Entry time-to-live (0 = never expires).", minimum=0, group="cache"),
    Spec("CACHE_TTL_MAX_SECONDS", "float", 3600.0, "Longest idle lifetime a client may ask for an entry (Anthropic cache_control ttl 1h, Responses prompt_cache_options.ttl / prompt_cache_retention); an entry is never kept shorter than PROMPT_CACHE_TTL_SECONDS (0 = no cap).", minimum=0, group="cache"),
    Spec("PROMPT_CACHE_SESSION_MAX_IDLE_SECONDS", "float", 1800.0, "Idle sessions are forgotten after this (0 = never).", minimum=0, group="cache"),
    Spec("PROMPT_CACHE_BLOCK_SIZE", "int", 16, "Tokens per hash block.", minimum=1, group="cache"),
    Spec("CACHE_USE_BLOCK_INDEX", "bool", True, "Block-hash index for O(blocks) lookup (off = linear scan, same answers).", group="cache"),
    Spec("CACHE_CANONICALIZE_TOOL_CONTEXT", "bool", True, "Normalise volatile agent fields (message ids, inbound context, runtime stats) in the cache key.", group="cache"),
    Spec("CACHE_VLM_IMAGE_IDENTITY", "bool", True, "Add per-image identity markers to VLM cache keys.", group="cache"),
    Spec("CACHE_SESSION_PARTITIONING", "bool", True, "Among cache entries that match a request equally deep, take the one the request's own session stored (global order -- most recently used -- otherwise), so another session's entry does not take the hit, the refresh and the lineage link. Never changes how deep a hit reuses. Counted in /v1/cache/stats counters: own_session_hits, other_session_hits, own_session_preferred.", group="cache"),
    Spec("CACHE_NORM_SAFETY_CHECK", "bool", False, "Refuse a cache key >10% shorter than the prompt (falls back to original tokens).", group="cache"),
    Spec("NORMALIZE_WRITE_TOOL_CONTENT_FOR_PROMPT", "bool", False, "In earlier assistant turns (never the last one, never tool results), replace a write tool's whole-file content argument (Write / write / write_file / create_file / write_to_file: content) with '[file content omitted: N bytes, sha256 XXXXXXXX]' in the model input, so old file writes stop costing their size every turn. Changes what the model sees; edit tools are left alone.", group="cache"),
    Spec("STRIP_BILLING_HEADER", "bool", True, "Remove Claude Code's per-request x-anthropic-billing-header line from the model input too.", group="cache"),
    Spec("HEALING_STORE", "bool", True, "Restore reasoning / raw tool-call markup that clients strip from echoed assistant turns.", group="cache"),
    Spec("HEALING_STORE_MAX_ENTRIES", "int", 2000, "LRU capacity of the healing store.", minimum=1, group="cache"),
    Spec("HEALING_STORE_MAX_BYTES", "int", 64 * 1024 * 1024, "Byte cap of the healing store (least recently used replies go first), and of its journal file beside the disk tier while running (compacted to the newest half when an append would pass it).", minimum=1024, group="cache"),
    Spec("CACHE_DIAGNOSTICS_MAX_ENTRIES", "int", 2048, "Request fingerprints kept for cache diagnoses (Anthropic diagnostics.previous_message_id, Responses prompt_cache_options.comparison_response_id, each session's previous request; one fingerprint under both its keys); hashes and token counts only, least recently used go first.", minimum=1, group="cache"),
    Spec("CACHE_DIAGNOSTICS_MAX_BYTES", "int", 64 * 1024 * 1024, "Byte cap of those fingerprints, measured: each holds 8 bytes per 16 tokens of prompt and reply, 64 per message and under 1 KB beside (76 KB for 100k tokens and 400 messages); the store never holds more.", minimum=1024, group="cache"),
    Spec("SESSION_STORE_MAX_BYTES", "int", 256 * 1024 * 1024, "Byte cap of the session turn store (each session's message history; least recently updated sessions go first).", minimum=1024, group="cache"),
    Spec("TOKENIZER_CACHE_MAX_BYTES", "int", 64 * 1024 * 1024, "Byte cap of the tokeniser's piece cache (pieces over 256k characters are never cached).", minimum=1024, group="cache"),
    Spec("SNAPSHOT_MAX_ENTRIES", "int", 8, "Hybrid/recurrent-model state snapshots kept (0 = off).", minimum=0, group="cache"),
    Spec("SNAPSHOT_TTL_SECONDS", "float", 1800.0, "Snapshot time-to-live (0 = never expires).", minimum=0, group="cache"),
    Spec("KV_BITS", "choice", "off", "KV cache quantisation: the live cache switches to its quantised form (KV_QUANT_SCHEME) at QUANTIZED_KV_START tokens, and stored entries (RAM and disk) keep K/V quantised from there on, full precision below it (2, 3, 4 or 8 bits; benchmarks/bench_kv_quant.py measures what each costs in quality).", choices=("off", "2", "3", "4", "8"), group="cache"),
    Spec("KV_GROUP_SIZE", "int", 64, "Quantisation group size along the head dimension (32, 64 or 128; must divide the model's head_dim).", minimum=32, group="cache"),
    Spec("QUANTIZED_KV_START", "int", 5000, "Tokens before which the live cache stays full precision. Stored entries hold what a cold run holds (full precision below it, quantised from it), so every hit is exact on both sides of it.", minimum=0, group="cache"),
    Spec("WARM_PROMPTS", "str", "", "A JSON or JSON-lines file of requests ({\"messages\": [...], \"tools\": [...]} or a bare message list) prefilled once the model is loaded, so the first real request is warm. Empty = none.", group="cache"),
    Spec("KV_QUANT_SCHEME", "choice", "uniform", "Quantisation scheme with KV_BITS: uniform (mlx-lm's QuantizedKVCache: mx.quantize affine groups of KV_GROUP_SIZE) or turboquant (each K/V vector rotated by a seeded random-sign Walsh-Hadamard transform, its coordinates coded with a Lloyd-Max codebook of the rotated distribution, one norm per vector; cache/turboquant.py). Stored entries (RAM and disk) hold the codes; attention reads the decoded vectors.", choices=("uniform", "turboquant"), group="cache"),
    Spec("RECURRENT_STATE_BITS", "choice", "off", "LOSSY, opt-in: the prompt cache keeps the states of recurrent layers (Mamba / SSM, conv, gated-delta: mlx-lm's ArraysCache) as TurboQuant codes of this many bits, in RAM and on disk (each state array coded along its last axis: seeded rotation, Lloyd-Max codebook, one float32 norm per vector: d * bits / 8 + 4 bytes for d floats, e.g. 68 (4) or 132 (8) against 512 in float32 at d = 128; arrays it cannot rotate or tiny ones stay exact; cache/state_codes.py), so more snapshots fit in PROMPT_CACHE_MAX_BYTES. A restored state is what the codes decode to, not what a cold run holds: a warm turn's reply may differ from a cold run's, which is why it is off by default and outside the parity tests (benchmarks/bench_kv_quant.py --parts recurrent measures the drift: docs/cache.md). Attention K/V are untouched (KV_BITS governs them). off = exact states.", choices=("off", "4", "8"), group="cache"),
    Spec("DISK_CACHE_DIR", "str", "auto", "Disk tier of the prompt KV cache (warm across restarts). auto = kv/ under MODEL_CACHE_DIR (default ~/.cache/mlxstack/kv); empty or off = no disk tier; relative paths are under the repo.", group="cache"),
    Spec("DISK_CACHE_MAX_BYTES", "int", 0, "Disk tier byte budget (least recently used evicted first). 0 = auto: 25% of (free disk + what the tier already holds) at start-up, at most 64 GiB.", minimum=0, group="cache"),
    Spec("DISK_KEEP_ON_EXIT", "bool", False, "At shutdown (SIGTERM, Ctrl-C) every RAM cache entry not on disk yet -- shorter than DISK_CACHE_MIN_TOKENS too -- is written to the disk tier first, so the next start of the same model finds every session warm (one server; not with DISTRIBUTED). MODELS_ON_DEMAND turns it on for the model servers it unloads.", group="cache"),
    Spec("DISK_CACHE_MIN_TOKENS", "int", 1024, "Write-through threshold: a new cache entry with at least this many tokens is also written to disk when created.", minimum=1, group="cache"),
    # --- vision ----------------------------------------------------------------
    Spec("MAX_IMAGE_BYTES", "int", 20 * 1024 * 1024, "Largest decoded image payload.", minimum=1, group="vision"),
    Spec("MAX_IMAGE_PIXELS", "int", 40_000_000, "Pixel cap per image (decompression-bomb guard).", minimum=1, group="vision"),
    Spec("MAX_IMAGE_PIXELS_PER_REQUEST", "int", 64_000_000, "Decoded-pixel budget over all images of one request (checked on the headers, before decoding).", minimum=1, group="vision"),
    Spec("ALLOW_REMOTE_IMAGE_URLS", "bool", False, "Fetch http(s) image URLs (off: only data: URLs).", group="vision"),
    Spec("REMOTE_IMAGE_TIMEOUT_SECONDS", "float", 10.0, "Total deadline (connect, read, redirects) for one remote image fetch.", minimum=0.1, group="vision"),
    # --- observability ---------------------------------------------------------
    Spec("ENABLE_REQUEST_LOGGING", "bool", True, "Write per-request session logs under LOG_ROOT.", group="observability"),
    Spec("LOG_ROOT", "str", "logs", "Log directory (relative paths are under the repo).", group="observability"),
    Spec("LOG_MAX_BYTES", "int", 256 * 1024 * 1024, "Cap on the total size of LOG_ROOT's session logs (oldest removed first).", minimum=1024, group="observability"),
    Spec("LOG_LEVEL", "choice", "INFO", "Console log level.", choices=("DEBUG", "INFO", "WARNING", "ERROR"), group="observability"),
    Spec("VLM_CACHE_DEBUG", "bool", False, "Log the first prompt token ids and VLM cache diagnostics.", group="observability"),
    # --- structured output (constrained decoding, mlxstack/constraints/) ---------
    Spec("GRAMMAR_CACHE_ENTRIES", "int", 64, "Compiled grammars (JSON schemas, tool-call grammars) kept, keyed by a hash of the grammar; least recently used go first (0 = compile every request).", minimum=0, group="structured output"),
    Spec("GRAMMAR_COMPILE_TIMEOUT_SECONDS", "float", 5.0, "A schema or tool set whose grammar does not compile within this long is refused with 400 (compiling runs beside the request's handler, never on the inference thread).", minimum=0.01, group="structured output"),
    Spec("GRAMMAR_MAX_PENDING", "int", 8, "Grammar compiles queued or running at once; past it a request that needs a new grammar gets 503 with Retry-After, and one client (its user / session_id) at most half of them (429). Failures are cached like successes, so a bad schema sent again costs nothing.", minimum=1, group="structured output"),
    Spec("GRAMMAR_MAX_SIZE", "int", 200000, "Largest grammar (llguidance symbols) a request may ask for; a bigger schema or tool set is refused with 400.", minimum=1000, group="structured output"),
    # --- speculative decoding (runner/spec/speculation.py, runner/spec/drafting.py) -------
    Spec("SPECULATIVE", "choice", "auto", "Speculative decoding inside continuous batching: drafts verified for every row of the batch in one forward; each row drafts only while its drafts pay. auto: prompt lookup (drafts copied from the prompt and the reply so far), and the draft model where the lookup finds nothing when DRAFT_MODEL is set. ngram: prompt lookup only. draft: the draft model only (needs DRAFT_MODEL). off: one token per step. Greedy replies are identical either way; sampled ones are distributed the same.", choices=("auto", "off", "ngram", "draft"), group="speculative decoding"),
    Spec("DRAFT_MODEL", "str", "", "A smaller model with the target's tokenizer (local MLX folder or a cached Hugging Face repo id) whose greedy tokens are the drafts; empty = none. A different vocabulary is refused at start.", group="speculative decoding"),
    Spec("DRAFT_WINDOW", "int", 2048, "Most tokens the draft model catches up on at once: a new request (or one far behind) starts its draft cache on the last this-many tokens, so a long agent prompt never stalls the batch for a draft prefill of the whole prompt (0 = the whole prompt; copies from further back are prompt lookup's).", minimum=0, group="speculative decoding"),
    Spec("DRAFT_CACHE_MAX_BYTES", "int", 1 << 30, "RAM for the draft model's caches of finished requests (a new request starts from the one sharing the longest prefix with its prompt); least recently used go first.", minimum=0, group="speculative decoding"),
    Spec("SPEC_MAX_DRAFT", "int", 12, "Most draft tokens a row tries in one step (its draft length adapts between 1 and this from what was accepted; 0 turns speculation off).", minimum=0, group="speculative decoding"),
    Spec("SPEC_CALIBRATE", "choice", "auto", "auto: at load, time the decode model's forward of 1 and 2..13 positions for 1 and 8 rows (about a second or two) -- the width chooser's costs before steps are timed; off: a constant prior until then. Skipped with DISTRIBUTED (ranks decide from the constant).", choices=("auto", "off"), group="speculative decoding"),
    Spec("SPEC_NGRAM_MAX", "int", 4, "Longest suffix (tokens) prompt lookup matches; it tries shorter ones down to SPEC_NGRAM_MIN.", minimum=1, group="speculative decoding"),
    Spec("SPEC_NGRAM_MIN", "int", 2, "Shortest suffix (tokens) prompt lookup accepts as a match.", minimum=1, group="speculative decoding"),
)

SPEC_BY_NAME: dict[str, Spec] = {s.name: s for s in SPECS}


def _attr(name: str) -> str:
    return name.lower()


def _parse(spec: Spec, raw: str) -> Any:
    text = raw.strip()
    try:
        if spec.kind == "str":
            return text
        if spec.kind == "choice":
            for choice in spec.choices:
                if text.lower() == choice.lower():
                    return choice
            raise SettingsError(
                f"{spec.name}={raw!r} is not one of {', '.join(spec.choices)}. {spec.doc}"
            )
        if spec.kind == "bool":
            low = text.lower()
            if low in _TRUE:
                return True
            if low in _FALSE:
                return False
            raise SettingsError(f"{spec.name}={raw!r} is not a boolean; use true or false. {spec.doc}")
        value: float = int(text) if spec.kind == "int" else float(text)
    except ValueError as exc:
        if isinstance(exc, SettingsError):
            raise
        raise SettingsError(f"{spec.name}={raw!r} is not a valid {spec.kind}. {spec.doc}") from None
    if spec.minimum is not None and value < spec.minimum:
        raise SettingsError(f"{spec.name}={raw!r} must be >= {spec.minimum:g}. {spec.doc}")
    return value


def _fields() -> list[tuple[str, Any, Any]]:
    types: dict[str, Any] = {"str": str, "int": int, "float": float, "bool": bool, "choice": str}
    return [(_attr(s.name), types[s.kind], dataclasses.field(default=s.default)) for s in SPECS]


_SettingsBase = dataclasses.make_dataclass("_SettingsBase", _fields(), frozen=True)


@dataclass(frozen=True)
class Settings(_SettingsBase):  # type: ignore[misc, valid-type]
    """All configuration. Attribute names are the lower-cased variable names."""

    def replace(self, **changes: Any) -> "Settings":
        return dataclasses.replace(self, **changes)

    # Derived values --------------------------------------------------------
    @property
    def log_root_path(self) -> Path:
        p = Path(self.log_root)
        return p if p.is_absolute() else REPO_ROOT / p

    @property
    def model_cache_path(self) -> Path:
        if self.model_cache_dir:
            return Path(self.model_cache_dir).expanduser()
        return Path.home() / ".cache" / "mlxstack"

    @property
    def cache_enabled(self) -> bool:
        return self.prompt_cache_max_entries_global > 0

    def as_env(self) -> dict[str, str]:
        """Serialise back to environment variables (for child processes)."""
        out = {}
        for spec in SPECS:
            value = getattr(self, _attr(spec.name))
            out[spec.name] = ("true" if value else "false") if spec.kind == "bool" else str(value)
        return out


def _read_env_file(path: Path) -> dict[str, str]:
    from dotenv import dotenv_values

    values = dotenv_values(path)
    return {k: v for k, v in values.items() if v is not None}


def load_settings(
    env: Mapping[str, str] | None = None,
    env_file: Path | str | None = None,
    *,
    strict_unknown: bool = True,
) -> Settings:
    """Build Settings from ``env`` (default: os.environ) layered over ``env_file``.

    Process environment wins over the file, as with python-dotenv's default.
    Unknown variables in the file are an error (a typo would otherwise be silently ignored).
    """
    merged: dict[str, str] = {}
    if env_file is None and env is None:
        env_file = REPO_ROOT / ".env"
    if env_file is not None and Path(env_file).exists():
        file_values = _read_env_file(Path(env_file))
        if strict_unknown:
            unknown = [k for k in file_values if k not in SPEC_BY_NAME and not k.startswith(("LITELLM_", "HF_", "MLX_STACK_"))]
            if unknown:
                hints = []
                for key in unknown:
                    close = difflib.get_close_matches(key, SPEC_BY_NAME, n=1)
                    hints.append(f"{key}" + (f" (did you mean {close[0]}?)" if close else ""))
                raise SettingsError(
                    f"Unknown variable(s) in {env_file}: {', '.join(hints)}. "
                    "Every supported variable is listed in .env.example."
                )
        merged.update(file_values)
    merged.update(os.environ if env is None else env)
    values = {}
    for spec in SPECS:
        raw = merged.get(spec.name)
        values[_attr(spec.name)] = spec.default if raw is None or raw.strip() == "" and spec.kind != "str" else _parse(spec, raw)
    _proxy_startup_limit(values, merged.get("PROXY_STARTUP_TIMEOUT_SECONDS"))
    model_aliases(values["model_aliases"])          # refused at start, not when LiteLLM's config is written
    if values["speculative"] == "draft" and not values["draft_model"].strip():
        raise SettingsError("SPECULATIVE=draft needs DRAFT_MODEL (a smaller model with the same tokenizer); "
                            "use SPECULATIVE=auto for prompt lookup without a draft model.")
    if values["distributed"] != "off" and values["distributed_local_ranks"] == 1:
        raise SettingsError("DISTRIBUTED_LOCAL_RANKS=1 is one process: use DISTRIBUTED=off, or 2 or more ranks.")
    if values["distributed"] != "off" and not values["distributed_local_ranks"] and not values["distributed_hosts"].strip():
        raise SettingsError(f"DISTRIBUTED={values['distributed']} needs its ranks: DISTRIBUTED_LOCAL_RANKS=N (N ranks on "
                            "this machine) or DISTRIBUTED_HOSTS=<hostfile> (mlx.launch's format, for several machines).")
    return Settings(**values)


def model_aliases(text: str) -> tuple[tuple[str, str], ...]:
    """MODEL_ALIASES parsed: ((pattern, target), ...) in the order given; () for off / empty.
    Raises SettingsError naming the entry that is not pattern=target."""
    text = text.strip()
    if not text or text.lower() == "off":
        return ()
    out = []
    for entry in (e.strip() for e in text.split(",")):
        if not entry:
            continue
        pattern, eq, target = (part.strip() for part in entry.partition("="))
        if not eq or not pattern or not target or any(c.isspace() for c in pattern + target):
            raise SettingsError(f"MODEL_ALIASES: {entry!r} is not pattern=target (e.g. claude-*sonnet*=main); "
                                "entries are comma-separated, with no spaces inside a name.")
        out.append((pattern, target))
    return tuple(out)


def _proxy_startup_limit(values: dict[str, Any], timeout_raw: str | None) -> None:
    """PROXY_STARTUP_WAIT_SECONDS (the seed's name) is the LiteLLM start-up limit when it is the
    only one set; both set to different values is an error naming both (never a silent pick)."""
    wait = values["proxy_startup_wait_seconds"].strip()
    values["proxy_startup_wait_seconds"] = wait
    if not wait:
        return
    seconds = _parse(Spec("PROXY_STARTUP_WAIT_SECONDS", "float", 0.0, "Seconds LiteLLM may take to report ready.",
                          minimum=1), wait)
    if timeout_raw is not None and timeout_raw.strip() and values["proxy_startup_timeout_seconds"] != seconds:
        raise SettingsError(
            f"PROXY_STARTUP_WAIT_SECONDS={wait} and PROXY_STARTUP_TIMEOUT_SECONDS={timeout_raw.strip()} are both set "
            "and differ: they are one limit (how long LiteLLM may take to report ready). Keep one of them.")
    values["proxy_startup_timeout_seconds"] = seconds


def render_env_example() -> str:
    """The canonical text of .env.example, grouped, every variable with its default."""
    lines = [
        "# mlxstack configuration. Copy to .env (install_and_run.py does it on first run).",
        "# Every supported variable is listed here with its default; unknown names in .env are an error.",
    ]
    group = None
    for spec in SPECS:
        if spec.group != group:
            group = spec.group
            lines += ["", f"# ---- {group} " + "-" * (60 - len(group))]
        default = ("true" if spec.default else "false") if spec.kind == "bool" else str(spec.default)
        choices = f" [{' | '.join(spec.choices)}]" if spec.choices else ""
        lines.append(f"# {spec.doc}{choices}")
        lines.append(f"{spec.name}={default}")
    return "\n".join(lines) + "\n"

