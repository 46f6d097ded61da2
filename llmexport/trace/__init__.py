"""The rewritten model as a graph: placeholder ops (eager reference + ONNX symbolic), the
eager run the runtime's way, and the ONNX export."""
