"""Work read from files and written to files: prompt files in, result files out, OpenAI-style
request files (resumable) and LAMBADA-style evaluation."""
