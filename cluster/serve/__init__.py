"""The Ray Serve front door: the args of `cluster.serve_app:build_app`, the `LLMServer` deployment
that holds an engine, and the OpenAI ingress deployment that forwards to it."""
