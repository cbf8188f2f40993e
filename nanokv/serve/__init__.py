"""The OpenAI-compatible HTTP server (`python -m nanokv.serve`): server.py is the app and
its command line, engine_thread.py the one thread that steps the LLM for every request,
openai_api.py the API's requests (checked), responses.py its responses."""
