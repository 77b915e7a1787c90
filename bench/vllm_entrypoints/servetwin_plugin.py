"""pytest plugin of the vLLM entrypoint bench (loaded with `-p servetwin_plugin` by
bench/vllm_entrypoint_tests.py): adapts vLLM's test plumbing to `servetwin serve` on a machine
without the HF hub. Nothing under tests/ is edited; this only monkeypatches harness-side helpers:

  * RemoteVLLMServer._pre_download_model (and RemoteLaunchRenderServer's): a no-op. It would fetch
    the test model's weights and tokenizer from the hub through vLLM's EngineArgs; servetwin serves
    its default model under the test's model name (see vllm_shim.sh).
  * SERVETWIN_BENCH_TOKENIZER_ALIAS=1 (the default): tests that build a tokenizer of the test model
    (vllm.tokenizers.get_tokenizer, transformers.AutoTokenizer.from_pretrained), read its config
    (transformers.AutoConfig.from_pretrained), its vLLM ModelConfig or the tests' reference model
    (HfRunner; both through maybe_model_redirect, vLLM's own model-redirect hook) or fetch its files
    (download_weights_from_hf) get the local folder of the model the server really serves,
    SERVETWIN_BENCH_MODEL_DIR, instead. =0 leaves them alone (they then fail for want of the hub).
    Every substitution is listed at the end of the module's pytest output.
  * hf_api().snapshot_download of a LoRA adapter repo (the LoRA fixtures of
    tests/entrypoints/conftest.py and test_chat.py): an empty folder under SERVETWIN_BENCH_FAKE_HUB,
    so that modules whose server fixture names an adapter can start (servetwin accepts and ignores
    --lora-modules; the LoRA tests are outside the selection). Any other repo: the real HfApi.

The driver sets SERVETWIN_BENCH_MODEL_DIR, SERVETWIN_BENCH_FAKE_HUB, HF_HUB_OFFLINE=1 and
VLLM_TARGET_DEVICE=cpu.
"""
import functools
import os
import tempfile

MODEL_DIR = os.environ.get("SERVETWIN_BENCH_MODEL_DIR", "")
FAKE_HUB = os.environ.get("SERVETWIN_BENCH_FAKE_HUB") or os.path.join(
    tempfile.gettempdir(), "servetwin-bench-fake-hub")
ALIASED = []  # (test, requested name) for the summary
# LoRA adapter repos of tests/entrypoints/conftest.py's fixtures whose id does not say "lora"
LORA_REPOS = {"vllm-project/self_cognition_Alice"}


def _alias(name):
    if isinstance(name, (str, os.PathLike)) and os.path.isdir(str(name)):
        return name
    ALIASED.append((os.environ.get("PYTEST_CURRENT_TEST", "?"), str(name)))
    return MODEL_DIR


def pytest_configure(config):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import tests.utils as tu

    def _no_download(self, model, args):
        return None

    tu.RemoteVLLMServer._pre_download_model = _no_download
    tu.RemoteLaunchRenderServer._pre_download_model = _no_download

    import vllm.transformers_utils.repo_utils as ru

    real_hf_api = ru.hf_api

    class _FakeHfApi:
        """snapshot_download of a LoRA adapter repo: an empty local folder; else the real API."""

        def snapshot_download(self, repo_id, *args, **kwargs):
            if "lora" not in repo_id.lower() and repo_id not in LORA_REPOS:
                return real_hf_api().snapshot_download(repo_id, *args, **kwargs)
            path = os.path.join(FAKE_HUB, repo_id)
            os.makedirs(path, exist_ok=True)
            ALIASED.append((os.environ.get("PYTEST_CURRENT_TEST", "?"),
                            f"snapshot_download({repo_id}) -> empty dir"))
            return path

        def __getattr__(self, name):
            return getattr(real_hf_api(), name)

    ru.hf_api = lambda: _FakeHfApi()

    if os.environ.get("SERVETWIN_BENCH_TOKENIZER_ALIAS", "1") != "1":
        return
    if not os.path.isdir(MODEL_DIR):
        raise RuntimeError(f"SERVETWIN_BENCH_MODEL_DIR={MODEL_DIR!r} is not a directory "
                           "(bench/vllm_entrypoint_tests.py sets it to servetwin's default model)")
    import vllm.tokenizers as vt
    orig_get = vt.get_tokenizer

    @functools.wraps(orig_get)
    def get_tokenizer(tokenizer_name=None, *args, **kwargs):
        return orig_get(_alias(tokenizer_name), *args, **kwargs)

    vt.get_tokenizer = get_tokenizer
    tu.get_tokenizer = get_tokenizer

    import transformers
    orig_from = transformers.AutoTokenizer.from_pretrained.__func__

    def from_pretrained(cls, name, *args, **kwargs):
        return orig_from(cls, _alias(name), *args, **kwargs)

    transformers.AutoTokenizer.from_pretrained = classmethod(from_pretrained)

    # vLLM's own ModelConfig (tests that read the model's config, e.g. its vocab size): the same
    # redirect vLLM offers through VLLM_MODEL_REDIRECT_PATH, for any hub name
    import vllm.config.model as vcm
    vcm.maybe_model_redirect = lambda model: str(_alias(model))
    # ... and the test model's config and weights in the tests' own reference runner (HfRunner,
    # e.g. the prompt_embeds tests' embeddings) and AutoConfig look-ups: the served model's
    import vllm.transformers_utils.utils as vtu
    vtu.maybe_model_redirect = lambda model: str(_alias(model))
    import tests.conftest as tc
    tc.maybe_model_redirect = vtu.maybe_model_redirect
    orig_config = transformers.AutoConfig.from_pretrained.__func__

    def config_from_pretrained(cls, name, *args, **kwargs):
        return orig_config(cls, _alias(name), *args, **kwargs)

    transformers.AutoConfig.from_pretrained = classmethod(config_from_pretrained)

    import vllm.model_executor.model_loader.weight_utils as wu

    def download_weights_from_hf(model_name_or_path, *args, **kwargs):
        return _alias(model_name_or_path)

    wu.download_weights_from_hf = download_weights_from_hf


def pytest_terminal_summary(terminalreporter):
    """Lists every hub look-up the plugin answered locally."""
    for test, name in sorted(set(ALIASED)):
        terminalreporter.write_line(f"servetwin_plugin: aliased {name} (-> {MODEL_DIR}) in {test}")
