"""Where the vendored public traces live, for the tests that read them."""
from pathlib import Path

TRACES = Path(__file__).resolve().parent.parent / "traces"
AZURE_CODE = TRACES / "AzureLLMInferenceTrace_code.csv"
AZURE_CONV = TRACES / "AzureLLMInferenceTrace_conv.csv"
