
template <typename V, int N>
struct alignas(sizeof(V) * N) UniVec {
    V v[N];
};
