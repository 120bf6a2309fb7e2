"""Every reason, refusal and failure code cgbuild emits: one registry, one meaning each.

Codes are part of the interface (plan JSON, mint results, adopt refusals, CI gates parse them),
so each is a `Code` member here and a row of docs/codes.md; a test holds the two to each other
and fails on a kebab-case code written anywhere in the source that is not registered. `Code` is
a `StrEnum`: a member IS its string, so JSON carries it unchanged and old readers keep working.
"""

from __future__ import annotations

from enum import StrEnum


class Code(StrEnum):
    # plan: why a target has its status
    NEW_TARGET = "new-target"
    AXIS_MOVED = "axis-moved"
    MISSING_FROM_STORE = "missing-from-store"
    QUARANTINED = "quarantined"
    TRACE_INPUT_MOVED = "trace-input-moved"
    EARLY_CUTOFF = "early-cutoff"
    GRAPH_UNKNOWN = "graph-unknown"
    PLAN_STALE = "plan-stale"
    # trace
    NO_CUDA_TORCH = "no-cuda-torch"
    ENTRY_ERROR = "entry-error"
    TRACE_FAILED = "trace-failed"
    LITERAL_HIDDEN = "literal-hidden"
    DIMENSION_MISMATCH = "dimension-mismatch"
    # layouts (plan, mint and adopt)
    LAYOUT_BELOW_SM_FLOOR = "layout-below-sm-floor"
    LAYOUT_TOOLCHAIN_UNSUPPORTED = "layout-toolchain-unsupported"
    LAYOUT_TOPOLOGY_MISMATCH = "layout-topology-mismatch"
    LAYOUT_DRIFT = "layout-drift"
    LAYOUT_MISMATCH = "layout-mismatch"
    LAYOUT_AMBIGUOUS = "layout-ambiguous"
    # mint
    BAD_REQUEST = "bad-request"
    WRONG_DEVICE = "wrong-device"
    WRONG_HOST = "wrong-host"
    TOOLCHAIN_DRIFT = "toolchain-drift"
    GRAPH_DRIFT = "graph-drift"
    COMPILE_FAILED = "compile-failed"
    CHECK_FAILED = "check-failed"
    SERVE_FAILED = "serve-failed"
    CLAMP_NOT_APPLIED = "clamp-not-applied"
    CONSTANT_TABLE_MISMATCH = "constant-table-mismatch"
    VERIFY_MISMATCH = "verify-mismatch"
    VERIFY_FAILED = "verify-failed"
    SEAL_FAILED = "seal-failed"
    MINT_ERROR = "mint-error"
    CONFLICT = "conflict"
    ONE_CANDIDATE = "one-candidate"
    OOM = "oom"
    TIMEOUT = "timeout"
    WORKER_KILLED = "worker-killed"
    WORKER_SIGNAL = "worker-signal"
    WORKER_CRASHED = "worker-crashed"
    RUN_FAILED = "run-failed"
    # store
    STORE_ERROR = "store-error"
    MISSING = "missing"
    CORRUPT = "corrupt"
    MALFORMED_REF = "malformed-ref"
    GC_RACE = "gc-race"
    DISK_FULL = "disk-full"
    IO_ERROR = "io-error"
    # shared store and trust
    REMOTE_ERROR = "remote-error"
    REMOTE_UNAVAILABLE = "remote-unavailable"
    UPLOAD_FAILED = "upload-failed"
    NO_CREDENTIALS = "no-credentials"
    NO_CONDITIONAL_WRITE = "no-conditional-write"
    RACY_CONDITIONAL_WRITE = "racy-conditional-write"
    NO_SIGNING_KEY = "no-signing-key"
    BAD_SIGNING_KEY = "bad-signing-key"
    UNSIGNED = "unsigned"
    UNKNOWN_SIGNER = "unknown-signer"
    BAD_SIGNATURE = "bad-signature"
    # fleet
    FLEET_ERROR = "fleet-error"
    FLEET_NODE_LOST = "fleet-node-lost"
    NO_NODE_FOR_SM = "no-node-for-sm"
    NO_GPU_FOR_SM = "no-gpu-for-sm"
    NOT_VISIBLE = "not-visible"
    WORKSPACE_DRIFT = "workspace-drift"
    WORKSPACE_MISSING = "workspace-missing"
    # lanes (the verdict's binding term and adopt's lane decision)
    NO_FIT = "no-fit"
    TIE_PEAK = "tie-peak"
    LANE_ADOPTED = "lane-adopted"
    LANE_REFIT = "lane-refit"
    LANE_REFIT_NO_FIT = "lane-refit-no-fit"
    LANE_UNVERIFIED = "lane-unverified"
    LANE_PINNED = "lane-pinned"
    # adopt refusals
    NO_ARTIFACT = "no-artifact"
    BAD_ARTIFACT = "bad-artifact"
    KEY_MISMATCH = "key-mismatch"
    LANE_SELECTOR = "lane-selector"
    WRONG_SM = "wrong-sm"
    TORCH_VERSION = "torch-version"
    HOST_ISA = "host-isa"
    HOST_RUNTIME = "host-runtime"
    COMPILER_FAMILY = "compiler-family"
    WEIGHTS_MISSING = "weights-missing"
    WEIGHTS_MISMATCH = "weights-mismatch"
    WEIGHTS_UNTIED = "weights-untied"
    LITERAL_MISMATCH = "literal-mismatch"
    CONFIG_DRIFT = "config-drift"
    MODULE_CHANGED = "module-changed"
    AUTOCAST = "autocast"
    GRAD = "grad"
    CALL_STRUCTURE = "call-structure"
    CONSTANT_ARG = "constant-arg"
    NOT_A_TENSOR = "not-a-tensor"
    DTYPE = "dtype"
    DEVICE = "device"
    SHAPE = "shape"
    STRIDE = "stride"
    SYMBOL_RANGE = "symbol-range"
    LOAD_FAILED = "load-failed"
    BAD_ARCHIVE = "bad-archive"
    BAD_MEMBER = "bad-member"
    BAD_PACKAGE = "bad-package"
    TOO_LARGE = "too-large"
    BAD_METADATA = "bad-metadata"
    BAD_LITERALS = "bad-literals"
    COMPILED_ERROR = "compiled-error"
    OUT_OF_ENVELOPE = "out-of-envelope"
    COMPILED_REQUIRED = "compiled-required"
    COPY_NOT_ADOPTED = "copy-not-adopted"
    MODULE_REPLACED = "module-replaced"


# A mint that failed with one of these may succeed on another attempt (another node, later);
# every other failure is a property of the key or the machine and will fail again. A result's
# `retryable` is `code in RETRYABLE`, never set by hand.
RETRYABLE: frozenset[Code] = frozenset(
    {
        Code.OOM,
        Code.TIMEOUT,
        Code.WORKER_KILLED,
        Code.WORKER_SIGNAL,
        Code.WORKER_CRASHED,
        Code.DISK_FULL,
        Code.IO_ERROR,
        Code.REMOTE_UNAVAILABLE,
        Code.UPLOAD_FAILED,
        Code.FLEET_ERROR,
        Code.FLEET_NODE_LOST,
        Code.COMPILED_REQUIRED,
    }
)
