"""The single HTTP endpoint: SGLang's and OpenAI's request shapes over the JetStream contract."""
