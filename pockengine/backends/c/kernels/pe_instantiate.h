/* Instantiates the kernel file that includes it for float (names suffixed _f32) and double
 * (_f64). A kernel file defines PE_SELF as its own name and includes this header while
 * PE_T is undefined; after its #else it holds its kernels once, written over PE_T and
 * PE_S(name). No include guard: each kernel file is its own translation unit. */
#define PE_T float
#define PE_U uint32_t /* the unsigned integer of PE_T's size (its bits) */
#define PE_TSIZE 4    /* sizeof(PE_T), for #if */
#define PE_S(name) name##_f32
#include PE_SELF
#undef PE_T
#undef PE_U
#undef PE_TSIZE
#undef PE_S
#define PE_T double
#define PE_U uint64_t
#define PE_TSIZE 8
#define PE_S(name) name##_f64
#include PE_SELF
#undef PE_T
#undef PE_U
#undef PE_TSIZE
#undef PE_S
