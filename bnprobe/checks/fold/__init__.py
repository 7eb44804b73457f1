"""fold: BatchNorm folded into a conv / linear layer (:mod:`.layer`), a folded file (:mod:`.folded`), an ONNX
graph's pairs (:mod:`.onnx_graph`) and its fused model (:mod:`.onnx_model`)."""
