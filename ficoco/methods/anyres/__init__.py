"""AnyRes images (LLaVA-NeXT and LLaVA-OneVision): where an image's visual tokens sit in the LLM's span and how the
items a method reduced before the LLM are packed there. The tensor code is in `ficoco.methods.anyres.ops`, shared by
ficoco's transformers adapters and its vLLM plugin; this package's own module stays torch-free, as the methods
package's shared modules do."""
