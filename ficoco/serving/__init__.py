"""Token reduction where models are served: one room per serving engine (`ficoco.serving.vllm`), each knowing
its engine's model classes and calling the same method ops on tensors as `ficoco.models` does on transformers'.
Neither imports the other; the accountant (`ficoco.accounting`) plans both."""
